"""Replay recorded attention: query/key/value vectors of a real model, from a ``.npz`` trace.

A trace holds, per recorded layer, the post-RoPE queries ``(L, H, T, d)``, keys
``(L, H_kv, T, d)`` and optionally values ``(L, H_kv, T, dv)`` (float16 or float32),
plus ``layers``: the model's index of each recorded layer, and ``scaling``: the model's
logit scale (default ``1 / sqrt(d)``). kvsim evaluates the logits ``q . k * scaling`` on
the fly (O(T d) memory), with the model's grouped-query layout. A trace is a file
(``path``) or a whole-model capture named by ``model``, ``text`` and ``tokens``
(:mod:`kvsim.attention.trace_cache`); one layer replays, or several (``layers``) jointly.
"""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path

import numpy as np

from kvsim.attention import trace_cache
from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, empty_field

REQUIRED = ("queries", "keys")


def trace_path(params: dict, base: Path) -> Path:
    """The trace file: ``path``, or the cached capture of ``model`` + ``text`` + ``tokens``."""
    if params["path"] and params["model"]:
        raise KvsimError("path: expected either a trace file or model + text + tokens, not both")
    if params["path"]:
        return (base / params["path"]).resolve()
    if not params["model"]:
        raise KvsimError("path: expected a trace file, or model + text + tokens for a "
                         "captured one, got nothing")
    for key in ("text", "tokens"):
        if not params[key]:
            raise KvsimError(f"{key}: expected a value with model = {params['model']!r}, "
                             f"got nothing")
    return trace_cache.resolve(params, base)


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise KvsimError(f"path: expected an existing .npz trace, got {str(path)!r}")
    stat = path.stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)  # the layers of one trace are built one after the other
def _read(path: str, mtime_ns: int, size: int) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise KvsimError(f"path: expected a readable .npz trace ({exc})") from None
    for name in REQUIRED:
        if name not in arrays:
            raise KvsimError(f"path: expected an array {name!r} in {Path(path).name}, "
                             f"found {sorted(arrays)}")
    for a in arrays.values():
        a.flags.writeable = False  # shared by every build of this trace
    return arrays


def _recorded(arrays: dict) -> list[int]:
    """The recorded layers, after the shape checks."""
    q, k, v = arrays["queries"], arrays["keys"], arrays.get("values")
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise KvsimError(f"path: expected queries (L, H, T, d) and keys (L, H_kv, T, d), got "
                         f"{q.shape} and {k.shape}")
    if q.shape[1] % k.shape[1]:
        raise KvsimError(f"path: expected KV heads ({k.shape[1]}) dividing query heads "
                         f"({q.shape[1]})")
    if v is not None and (v.ndim != 4 or v.shape[:3] != k.shape[:3]):
        raise KvsimError(f"path: expected values (L, H_kv, T, dv) matching keys, got {v.shape}")
    return [int(x) for x in arrays.get("layers", np.arange(q.shape[0]))]


def selected_layers(params: dict, base: Path) -> tuple[int, ...]:
    """The model layers the scenario replays: ``layers`` (a list or "all"), else ``layer``."""
    recorded = _recorded(_load(trace_path(params, base)))
    if params["layers"] and params["layer"] >= 0:
        raise KvsimError("layers: expected either layer or layers, not both")
    if params["layers"] == "all":
        return tuple(recorded)
    chosen = params["layers"] or [params["layer"] if params["layer"] >= 0 else recorded[0]]
    key = "layers" if params["layers"] else "layer"
    for layer in chosen:
        if layer not in recorded:
            raise KvsimError(f"{key}: expected one of the recorded layers {recorded}, "
                             f"got {layer}")
    return tuple(chosen)


def describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    """(T, query heads, KV heads, has ground truth) of the selection, after every check
    (every selected layer is built once)."""
    for layer in selected_layers(params, base):
        field = build({**params, "layers": [], "layer": layer}, 0, base)
    return field.T, field.heads, field.keys.shape[0], False


def build(params: dict, seed: int, base: Path) -> FieldData:
    """The field of the selected layer (``layer``, default the first), KV heads and length."""
    path = trace_path(params, base)
    arrays = _load(path)
    recorded = _recorded(arrays)
    layer = params["layer"] if params["layer"] >= 0 else recorded[0]
    if layer not in recorded:
        raise KvsimError(f"layer: expected one of the recorded layers {recorded}, got {layer}")
    i = recorded.index(layer)
    q, k, v = arrays["queries"], arrays["keys"], arrays.get("values")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        if a is not None and not np.isfinite(a[i]).all():
            raise KvsimError(f"path: expected finite {name} in layer {layer}")
    H_kv, T_all = k.shape[1], k.shape[2]
    group = q.shape[1] // H_kv
    kv_ids = params["kv_head_ids"] or list(range(H_kv))
    if any(not 0 <= x < H_kv for x in kv_ids) or len(set(kv_ids)) != len(kv_ids):
        raise KvsimError(f"kv_head_ids: expected distinct KV heads in [0, {H_kv}), got {kv_ids}")
    T = params["T"] or T_all
    if T > T_all:
        raise KvsimError(f"T: expected at most the recorded {T_all} tokens, got {T}")
    heads = [kv * group + g for kv in kv_ids for g in range(group)]
    f = empty_field(len(heads), T, len(kv_ids))
    f["queries"] = np.ascontiguousarray(q[i, heads, :T], dtype=np.float32)
    f["keys"] = np.ascontiguousarray(k[i, kv_ids, :T].transpose(0, 2, 1), dtype=np.float32)
    if v is not None:
        f["values"] = np.ascontiguousarray(v[i, kv_ids, :T], dtype=np.float32)
        f["value_heads"] = np.ones(len(kv_ids), bool)
    scale = float(arrays["scaling"]) if "scaling" in arrays else 1.0 / np.sqrt(q.shape[3])
    f["qk_scale"] = np.full(len(heads), scale)
    return FieldData(**f)
