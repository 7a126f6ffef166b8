"""Replay recorded attention: query/key/value vectors of a real model, from a ``.npz`` trace.

A trace holds, per recorded layer, the post-RoPE queries ``(L, H, T, d)``, keys
``(L, H_kv, T, d)`` and optionally values ``(L, H_kv, T, dv)`` (float16 or float32),
plus ``layers``: the model's index of each recorded layer, ``scaling``: the model's
logit scale (default ``1 / sqrt(d)``), and ``windows``: each recorded layer's sliding
window, 0 for a global layer (default: every layer global). kvsim evaluates the logits ``q . k * scaling`` on
the fly (O(T d) memory), with the model's grouped-query layout. A trace of capture version 3
also holds the queries before RoPE, ``pre_rope_queries`` (shaped as ``queries``), and each
recorded layer's RoPE: ``rope_freq`` (L, n) inverse frequencies rotating the first ``2 n``
dimensions in the rotate-half layout (dimension ``i`` pairs with ``i + n``), ``rope_scale``
(L,) the factor on cos and sin, and ``rope_theta`` (L,) the base (for reading); only the
policies that need them (``expected_attention``) require them. Every array is checked
on load (:func:`check`), before any work. A trace is a file (``path``) or a whole-model
capture named by ``model``, ``text`` and ``tokens`` (:mod:`kvsim.attention.trace_cache`);
one layer replays, or several (``layers``) jointly.

Only global layers replay: a sliding-window layer (Gemma-3: five in six) attends causally
*and* within its window, a field kvsim does not build, and a policy has nothing to compress
there (its window is its cache). Selecting one is an error; ``layers = "all"`` means every
recorded global layer.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from kvsim.attention import files, trace_cache
from kvsim.errors import KvsimError
from kvsim.paths import regular_file
from kvsim.numerics.field import FieldData, empty_field

REQUIRED = ("queries", "keys")
OPTIONAL = ("values", "layers", "scaling", "windows")
ROPE = ("pre_rope_queries", "rope_freq", "rope_scale", "rope_theta")  # capture version 3
MAX_LOGIT = 1e12  # bound on |q . k * scaling|: logits far beyond any model's stay exact
MAX_ENTRY = 1e30  # vectors are replayed in float32 (range 3.4e38)


def trace_path(params: dict, base: Path) -> Path:
    """The trace file: ``path``, or the cached capture of ``model`` + ``text`` + ``tokens``."""
    if params["path"] and params["model"]:
        raise KvsimError("expected either a trace file or model + text + tokens, not both",
                         "path")
    if params["path"]:
        return Path(os.path.realpath(base / params["path"]))  # a symlink loop: not an error here
    if not params["model"]:
        raise KvsimError("expected a trace file, or model + text + tokens for a captured one, "
                         "got nothing", "path")
    for key in ("text", "tokens"):
        if not params[key]:
            raise KvsimError(f"expected a value with model = {params['model']!r}, got nothing",
                             key)
    return trace_cache.resolve(params, base)


def _checked(path: Path) -> tuple[dict[str, np.ndarray], list[int], dict[int, int]]:
    """The trace's arrays, its recorded global layers (those that replay) and the window
    of each recorded sliding-window layer, after :func:`check` (memoised while the file is
    unchanged: the layers of one trace are built one after the other)."""
    try:
        regular_file(path)
    except ValueError as exc:
        raise KvsimError(f"expected an existing .npz trace, got {str(path)!r} ({exc})",
                         "path") from None
    stat = path.stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def _read(path: str, mtime_ns: int, size: int) -> tuple[dict[str, np.ndarray], list[int],
                                                        dict[int, int]]:
    arrays = _load(Path(path))
    recorded = check(arrays)
    for a in arrays.values():
        a.flags.writeable = False  # shared by every build of this trace
    windows = arrays.get("windows", np.zeros(len(recorded), np.int64))
    local = {layer: int(w) for layer, w in zip(recorded, windows) if w}
    global_layers = [layer for layer in recorded if layer not in local]
    if not global_layers:
        _fail(f"expected a global layer among the recorded layers, got only sliding-window "
              f"layers {recorded} (windows {sorted(set(local.values()))}), which kvsim does "
              f"not replay")
    return arrays, global_layers, local


def _load(path: Path) -> dict[str, np.ndarray]:
    found = files.headers(path)
    if list(found) == [""]:
        raise KvsimError("expected a .npz trace (named arrays queries, keys, ...), got a "
                         "single .npy array", "path")
    for name in REQUIRED:
        if name not in found:
            raise KvsimError(f"expected an array {name!r} in {path.name}, found "
                             f"{sorted(found)}", "path")
    return files.load(path, [*REQUIRED, *OPTIONAL, *ROPE], "the trace")


def _fail(message: str) -> None:
    raise KvsimError(message, "path")


def check(arrays: dict[str, np.ndarray]) -> list[int]:
    """Check a trace's arrays (shapes, dtypes, finiteness, ``scaling``, ``layers``);
    returns the model layer index of each recorded layer."""
    q, k, v = arrays["queries"], arrays["keys"], arrays.get("values")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        if a is not None and not np.issubdtype(a.dtype, np.floating):
            _fail(f"expected floating-point {name}, got dtype {a.dtype}")
    if q.ndim != 4 or k.ndim != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
            or 0 in q.shape or 0 in k.shape:
        _fail(f"expected queries (L, H, T, d) and keys (L, H_kv, T, d), none empty, got "
              f"{q.shape} and {k.shape}")
    if q.shape[1] % k.shape[1]:
        _fail(f"expected KV heads ({k.shape[1]}) dividing query heads ({q.shape[1]})")
    if v is not None and (v.ndim != 4 or v.shape[:3] != k.shape[:3] or v.shape[3] == 0):
        _fail(f"expected values (L, H_kv, T, dv) matching keys {k.shape}, got {v.shape}")
    for name, a in (("queries", q), ("keys", k), ("values", v)):
        if a is not None and not np.isfinite(a).all():
            _fail(f"expected finite {name}")
        if a is not None and float(np.abs(a).max()) > MAX_ENTRY:
            _fail(f"expected {name} within +-{MAX_ENTRY:g} (replayed in float32), got "
                  f"{float(np.abs(a).max()):.3g}")
    d = q.shape[3]
    scaling = 1.0 / np.sqrt(d)
    if "scaling" in arrays:
        s = arrays["scaling"]
        if s.shape != () or not (np.issubdtype(s.dtype, np.floating)
                                 or np.issubdtype(s.dtype, np.integer)) \
                or not np.isfinite(s) or not s > 0:
            _fail(f"expected scaling to be a positive finite number, got "
                  f"{s.tolist() if s.size <= 4 else f'an array of shape {s.shape}'}")
        scaling = float(s)
    bound = float(np.abs(q).max()) * float(np.abs(k).max()) * d * scaling
    if not bound <= MAX_LOGIT:
        _fail(f"expected logits q . k * scaling within +-{MAX_LOGIT:g}, got vectors that "
              f"reach {bound:.3g}")
    L = q.shape[0]
    _check_windows(arrays, L)
    _check_rope(arrays, q.shape)
    if "layers" not in arrays:
        return list(range(L))
    layers = arrays["layers"]
    if layers.ndim != 1 or not np.issubdtype(layers.dtype, np.integer) or layers.size != L \
            or (layers < 0).any() or np.unique(layers).size != L:
        _fail(f"expected layers: {L} distinct layer indices >= 0 (one per recorded layer), "
              f"got {layers.tolist() if layers.size <= 8 else layers.shape}")
    return [int(x) for x in layers]


def _check_windows(arrays: dict[str, np.ndarray], L: int) -> None:
    w = arrays.get("windows")
    if w is not None and (w.ndim != 1 or not np.issubdtype(w.dtype, np.integer)
                          or w.size != L or (w < 0).any()):
        _fail(f"expected windows: {L} integers >= 0 (each recorded layer's sliding window, "
              f"0 for a global layer), got {w.tolist() if w.size <= 8 else w.shape}")


def _check_rope(arrays: dict[str, np.ndarray], shape: tuple[int, ...]) -> None:
    """The RoPE arrays of a version-3 trace: all or none, shaped and finite."""
    present = [name for name in ROPE if name in arrays]
    if not present:
        return
    if len(present) < len(ROPE):
        _fail(f"expected the RoPE arrays {', '.join(ROPE)} together, got only "
              f"{', '.join(present)}")
    pre, freq = arrays["pre_rope_queries"], arrays["rope_freq"]
    scale, theta = arrays["rope_scale"], arrays["rope_theta"]
    L, d = shape[0], shape[3]
    if pre.shape != shape or not np.issubdtype(pre.dtype, np.floating) \
            or not np.isfinite(pre).all() or float(np.abs(pre).max()) > MAX_ENTRY:
        _fail(f"expected pre_rope_queries: finite floats shaped as the queries {shape}, got "
              f"{pre.shape} of {pre.dtype}")
    if freq.ndim != 2 or freq.shape[0] != L or not 1 <= 2 * freq.shape[1] <= d \
            or not np.issubdtype(freq.dtype, np.floating) or not np.isfinite(freq).all() \
            or (freq < 0).any():
        _fail(f"expected rope_freq: (layers {L}, n) inverse frequencies >= 0 with 1 <= 2 n <= "
              f"head dim {d}, got {freq.shape} of {freq.dtype}")
    for name, a in (("rope_scale", scale), ("rope_theta", theta)):
        if a.shape != (L,) or not np.issubdtype(a.dtype, np.floating):
            _fail(f"expected {name}: {L} floats (one per recorded layer), got {a.shape} of "
                  f"{a.dtype}")
    if not (np.isfinite(scale).all() and (scale > 0).all()):
        _fail(f"expected rope_scale > 0 and finite, got {scale.tolist()}")


def provides(params: dict, base: Path) -> frozenset:
    """What a trace has besides attention: vectors, and ``rope`` from capture version 3."""
    found = files.headers(trace_path(params, base))
    return frozenset({"keys", "values", "queries"} | ({"rope"} if "pre_rope_queries" in found
                                                       else set()))


def rope_note(params: dict, base: Path) -> str:
    """Why a trace file lacks what ``expected_attention`` needs and how to recapture it
    (empty when it has them, or names no file): the tail of a missing-needs error."""
    if not params.get("path"):
        return ""  # captured on demand: at the current capture version
    path = trace_path(params, base)
    if "pre_rope_queries" in files.headers(path):
        return ""
    return (f": {params['path']} was captured without them (capture version < 3); recapture "
            f"it with `{_recapture(path, params['path'])}`")


def _recapture(path: Path, name: str) -> str:
    """The capture command of a trace, from its ``meta`` where it has one (the text is
    not recorded, only its hash)."""
    try:
        with np.load(path) as data:
            meta = json.loads(str(data["meta"]))
        options = [f"--model {meta['model']}"]
        if meta.get("gguf_file"):
            options.append(f"--gguf-file {meta['gguf_file']}")
        options += ["--text TEXT", f"--tokens {int(meta['tokens'])}",
                    f"--layers {','.join(str(int(x)) for x in meta['layers'])}"]
    except (*files.READ_ERRORS, TypeError):
        options = ["--model MODEL", "--text TEXT"]
    return " ".join(["python -m kvsim capture", *options, f"--out {name}"])


def select_layer(layers: list[int], requested: int | None, key: str = "layer",
                 local: dict[int, int] | None = None) -> int:
    """Index in ``layers`` (the recorded global layers) of the model layer ``requested``
    (None: the first); ``local``: the window of each recorded sliding-window layer."""
    if requested is None:
        return 0
    if local and requested in local:
        raise KvsimError(f"expected a global layer ({layers}), got {requested}, a "
                         f"sliding-window layer (window {local[requested]}), which kvsim "
                         f"does not replay", key)
    if requested not in layers:
        raise KvsimError(f"expected one of the recorded layers {layers}, got {requested}", key)
    return layers.index(requested)


def selected_layers(params: dict, base: Path) -> tuple[int, ...]:
    """The model layers the scenario replays: ``layers`` (a list or "all"), else ``layer``."""
    _, recorded, local = _checked(trace_path(params, base))
    if params["layers"] is None:
        return (recorded[select_layer(recorded, params["layer"], "layer", local)],)
    if params["layer"] is not None:
        raise KvsimError("expected either layer or layers, not both", "layers")
    if params["layers"] == "all":
        return tuple(recorded)
    for layer in params["layers"]:
        select_layer(recorded, layer, "layers", local)
    return tuple(params["layers"])


def describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    """(T, query heads, KV heads, has ground truth) of the selection, after every check
    (every selected layer is built once)."""
    for layer in selected_layers(params, base):
        field = build({**params, "layers": None, "layer": layer}, 0, base)
    return field.T, field.heads, field.keys.shape[0], False


def build(params: dict, seed: int, base: Path) -> FieldData:
    """The field of the selected layer (``layer``, default the first recorded), KV heads
    and length."""
    arrays, recorded, local = _checked(trace_path(params, base))
    layer = recorded[select_layer(recorded, params["layer"], "layer", local)]
    i = [int(x) for x in arrays["layers"]].index(layer) if "layers" in arrays else layer
    q, k, v = arrays["queries"], arrays["keys"], arrays.get("values")
    H_kv, T_all = k.shape[1], k.shape[2]
    group = q.shape[1] // H_kv
    kv_ids = params["kv_head_ids"] or list(range(H_kv))
    if any(not 0 <= x < H_kv for x in kv_ids) or len(set(kv_ids)) != len(kv_ids):
        raise KvsimError(f"expected distinct KV heads in [0, {H_kv}), got {kv_ids}",
                         "kv_head_ids")
    T = params["T"] or T_all
    if T > T_all:
        raise KvsimError(f"expected at most the recorded {T_all} tokens, got {T}", "T")
    heads = [kv * group + g for kv in kv_ids for g in range(group)]
    scale = float(arrays["scaling"]) if "scaling" in arrays else 1.0 / np.sqrt(q.shape[3])
    rope = None
    if "pre_rope_queries" in arrays:
        rope = (arrays["pre_rope_queries"][i, heads, :T], arrays["rope_freq"][i],
                float(arrays["rope_scale"][i]))
    return layer_field(q[i, heads, :T], k[i, kv_ids, :T],
                       None if v is None else v[i, kv_ids, :T], scale, rope)


def layer_field(queries: np.ndarray, keys: np.ndarray, values: np.ndarray | None,
                scaling: float, rope: tuple | None = None) -> FieldData:
    """The field of one layer's post-RoPE ``queries`` (H, T, d), ``keys`` (H_kv, T, d) and
    ``values`` (H_kv, T, dv) or None, with logits ``q . k * scaling``; ``rope``, if given:
    (pre-RoPE queries (H, T, d), inverse frequencies (n,), cos/sin factor)."""
    H, T = queries.shape[:2]
    f = empty_field(H, T, keys.shape[0])
    f["queries"] = np.ascontiguousarray(queries, dtype=np.float32)
    f["keys"] = np.ascontiguousarray(keys.transpose(0, 2, 1), dtype=np.float32)
    if values is not None:
        f["values"] = np.ascontiguousarray(values, dtype=np.float32)
        f["value_heads"] = np.ones(keys.shape[0], bool)
    f["qk_scale"] = np.full(H, float(scaling))
    if rope is not None:
        f["pre_rope_queries"] = np.ascontiguousarray(rope[0], dtype=np.float32)
        f["rope_freq"] = np.ascontiguousarray(rope[1], dtype=np.float64)
        f["rope_scale"] = float(rope[2])
    return FieldData(**f)
