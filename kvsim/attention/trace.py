"""Replay recorded attention: query/key/value vectors of a real model, from a ``.npz`` trace.

A trace holds, per recorded layer, the post-RoPE queries ``(L, H, T, d)``, keys
``(L, H_kv, T, d)`` and optionally values ``(L, H_kv, T, dv)`` (float16 or float32),
plus ``layers``: the model's index of each recorded layer, and ``scaling``: the model's
logit scale (default ``1 / sqrt(d)``). kvsim evaluates the logits ``q . k * scaling`` on
the fly (O(T d) memory), with the model's grouped-query layout.
"""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, empty_field

REQUIRED = ("queries", "keys")


def _load(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise KvsimError(f"path: expected an existing .npz trace, got {str(path)!r}")
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {name: data[name] for name in data.files}
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise KvsimError(f"path: expected a readable .npz trace ({exc})") from None
    for name in REQUIRED:
        if name not in arrays:
            raise KvsimError(f"path: expected an array {name!r} in {path.name}, "
                             f"found {sorted(arrays)}")
    return arrays


def _checked(arrays: dict, params: dict, path: Path) -> tuple[np.ndarray, np.ndarray,
                                                             np.ndarray | None, int]:
    """The selected layer's (queries, keys, values or None, layer index) after checks."""
    q, k, v = arrays["queries"], arrays["keys"], arrays.get("values")
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise KvsimError(f"path: expected queries (L, H, T, d) and keys (L, H_kv, T, d), got "
                         f"{q.shape} and {k.shape}")
    if q.shape[1] % k.shape[1]:
        raise KvsimError(f"path: expected KV heads ({k.shape[1]}) dividing query heads "
                         f"({q.shape[1]})")
    if v is not None and (v.ndim != 4 or v.shape[:3] != k.shape[:3]):
        raise KvsimError(f"path: expected values (L, H_kv, T, dv) matching keys, got {v.shape}")
    layers = [int(x) for x in arrays.get("layers", np.arange(q.shape[0]))]
    layer = params["layer"] if params["layer"] >= 0 else layers[0]
    if layer not in layers:
        raise KvsimError(f"layer: expected one of the recorded layers {layers}, got {layer}")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        if a is not None and not np.isfinite(a[layers.index(layer)]).all():
            raise KvsimError(f"path: expected finite {name} in layer {layer}")
    return q, k, v, layers.index(layer)


def describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    """(T, query heads, KV heads, has ground truth) of the selection, after every check."""
    field = build(params, 0, base)
    return field.T, field.heads, field.keys.shape[0], False


def build(params: dict, seed: int, base: Path) -> FieldData:
    """The field of the selected layer, KV heads and length."""
    path = (base / params["path"]).resolve()
    arrays = _load(path)
    q, k, v, i = _checked(arrays, params, path)
    H_kv, T_all = k.shape[1], k.shape[2]
    group = q.shape[1] // H_kv
    kv_ids = params["kv_head_ids"] or list(range(H_kv))
    if any(not 0 <= x < H_kv for x in kv_ids) or len(set(kv_ids)) != len(kv_ids):
        raise KvsimError(f"kv_head_ids: expected distinct KV heads in [0, {H_kv}), got {kv_ids}")
    T = params["T"] or T_all
    if T > T_all:
        raise KvsimError(f"T: expected at most the recorded {T_all} tokens, got {T}")
    heads = [kv * group + g for kv in kv_ids for g in range(group)]
    scale = float(arrays["scaling"]) if "scaling" in arrays else 1.0 / np.sqrt(q.shape[3])
    return layer_field(q[i, heads, :T], k[i, kv_ids, :T],
                       None if v is None else v[i, kv_ids, :T], scale)


def layer_field(queries: np.ndarray, keys: np.ndarray, values: np.ndarray | None,
                scaling: float) -> FieldData:
    """The field of one layer's post-RoPE ``queries`` (H, T, d), ``keys`` (H_kv, T, d) and
    ``values`` (H_kv, T, dv) or None, with logits ``q . k * scaling``."""
    H, T = queries.shape[:2]
    f = empty_field(H, T, keys.shape[0])
    f["queries"] = np.ascontiguousarray(queries, dtype=np.float32)
    f["keys"] = np.ascontiguousarray(keys.transpose(0, 2, 1), dtype=np.float32)
    if values is not None:
        f["values"] = np.ascontiguousarray(values, dtype=np.float32)
        f["value_heads"] = np.ones(keys.shape[0], bool)
    f["qk_scale"] = np.full(H, float(scaling))
    return FieldData(**f)
