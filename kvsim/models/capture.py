"""Record the post-RoPE queries, keys and values of a Hugging Face causal LM (``kvsim capture``).

The model runs once on the CPU through kvsim's attention function
(:mod:`kvsim.models.adapter`), whose recording pass calls the model's own eager attention
with the causal (and windowed) mask transformers would build. It records, for each chosen
layer, the query, key and value tensors (after rotary embedding, before any KV repetition)
and the attention weights, and each layer's sliding window (0 for a global layer: a
Gemma-3 trace records five local layers for each global one, and ``windows`` says which);
and the queries before RoPE, computed from the layer's projections
(:func:`kvsim.models.adapter.pre_rope_queries`), with each layer's RoPE inverse
frequencies, cos/sin factor and base, checked to rotate into the recorded queries. Before
saving, the trace is checked: the causal (and windowed) softmax of ``q . k * scaling``
recomputed from the stored float16 vectors must reproduce those weights to float16
precision. Needs the optional extra (:data:`kvsim.models.preflight.INSTALL`: PyTorch's CPU
wheel first on a machine without a GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from kvsim._version import __version__
from kvsim.models.rope import rotate
from kvsim.errors import KvsimError
from kvsim.models import catalog
from kvsim.models import adapter, gguf_tokenizer
from kvsim.models.preflight import INSTALL
from kvsim.npz import write_npz
from kvsim.paths import read_text

TOLERANCE = 2e-3  # max |p_replayed - p_model| allowed: float16 vectors, float32 model
CAPTURE_VERSION = 3  # part of the on-demand cache key: bump when a capture would differ
# 2: the per-layer sliding windows (array ``windows``); a version-1 trace reads as global
# 3: the pre-RoPE queries and each layer's RoPE (``pre_rope_queries``, ``rope_freq``,
#    ``rope_scale``, ``rope_theta``); older traces replay for every policy but
#    ``expected_attention``
ROPE_TOLERANCE = 2e-3  # max |R_t q_pre - q| / max |q| of a layer: float32 angles at t ~ 4k


def _imports():
    try:
        import torch
        import transformers
    except ImportError:
        raise KvsimError(f"capture needs torch and transformers: {INSTALL}") from None
    return torch, transformers


def load_model(model: str, gguf_file: str | None = None):
    """(model, tokenizer) from a named model (:mod:`kvsim.models.catalog`: ``smollm2-135m``,
    ``gemma3-270m``), a local directory or a cached hub id; eager attention, float32.

    Never downloads: a model that is not on disk, or a local one of a family kvsim does not
    support (:data:`kvsim.models.catalog.FAMILIES`), is a one-line :class:`KvsimError`.
    """
    if catalog.preset(model) is not None:
        folder, gguf_file = catalog.resolve(model)
        model = str(folder)
    problem = catalog.family_problem(Path(model), gguf_file) if Path(model).is_dir() else None
    if problem:  # before torch is imported and any weights load
        raise KvsimError(f"--model: {problem}")
    torch, transformers = _imports()
    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = gguf_tokenizer.load(model, gguf_file) if gguf_file else \
            transformers.AutoTokenizer.from_pretrained(model, **kwargs)
        net = transformers.AutoModelForCausalLM.from_pretrained(
            model, attn_implementation="eager", dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvsimError(f"--model: expected a model on disk ({model}"
                         f"{', ' + gguf_file if gguf_file else ''}): {first}") from None
    return net.eval(), tokenizer


def record(net, token_ids: np.ndarray, layers: list[int] | None = None,
           dtype=np.float16) -> dict:
    """Run ``net`` on ``token_ids`` and return the trace arrays of the chosen layers, the
    vectors stored as ``dtype`` (float16, or float32 where float16 is not precise enough).

    The model runs through kvsim's attention function (:mod:`kvsim.models.adapter`), whose
    recording pass calls the model's own eager attention with the causal (and windowed)
    mask it would have built. Each layer is checked (see :func:`check`) as the model
    computes it and only its vectors are kept, so all 30 layers of SmolLM2 at 2,048 tokens
    fit in a few hundred MB.
    """
    torch, _ = _imports()
    n_layers = net.config.num_hidden_layers
    layers = list(range(n_layers)) if layers is None else layers
    if any(not 0 <= layer < n_layers for layer in layers):
        raise KvsimError(f"--layers: expected layer indices in [0, {n_layers}), got {layers}")
    eager = sys.modules[type(net.model.layers[0].self_attn).__module__].eager_attention_forward
    seen: dict = {}
    pre_rope: dict = {}

    def recording(layer, query, key, value, geometry):
        module = net.model.layers[layer].self_attn
        T = query.shape[2]
        mask = torch.zeros(T, T, dtype=query.dtype).masked_fill(  # as transformers builds it
            adapter.hidden_keys(T, geometry.window), torch.finfo(query.dtype).min)[None, None]
        output, weights = eager(module, query, key, value, mask, scaling=geometry.scaling,
                                dropout=0.0)
        pre = pre_rope.pop(layer).numpy()  # every layer's: only the chosen ones' are kept
        if layer in layers:
            if geometry.softcap:
                raise KvsimError(f"capture: layer {layer} softcaps its attention "
                                 f"logits, which a trace does not replay")
            rope = adapter.rope_settings(net, module)
            _check_rope(layer, pre, query[0].numpy(), rope)
            q, k, v = (x[0].numpy().astype(dtype) for x in (query, key, value))
            deviation = _deviation(q, k, geometry.scaling, weights[0].numpy(), geometry.window)
            seen[layer] = (q, k, v, geometry.scaling, geometry.window, deviation,
                           pre.astype(dtype), rope)
        return output, weights

    previous = net.config._attn_implementation
    adapter.attach(net)
    try:
        adapter.forward(net, token_ids, recording, queries=pre_rope)
    finally:
        net.set_attn_implementation(previous)
    missing = [layer for layer in layers if layer not in seen]
    if missing:
        raise KvsimError(f"capture: the model's attention was not called for layers "
                         f"{missing}; is it a supported causal LM?")
    q, k, v, scale, window, deviation, pre, rope = zip(*(seen[layer] for layer in layers))
    if len(set(scale)) > 1:
        raise KvsimError(f"capture: expected one attention scaling for every layer (a trace "
                         f"stores one), got {sorted(set(scale))}")
    _within_tolerance(max(deviation))
    return {"queries": np.stack(q), "keys": np.stack(k), "values": np.stack(v),
            "layers": np.array(layers, np.int64), "scaling": np.array(scale[0]),
            "windows": np.array(window, np.int64), "token_ids": np.asarray(token_ids, np.int64),
            "pre_rope_queries": np.stack(pre), "rope_freq": np.stack([r[0] for r in rope]),
            "rope_scale": np.array([r[1] for r in rope]),
            "rope_theta": np.array([r[2] for r in rope])}


def _check_rope(layer: int, pre: np.ndarray, post: np.ndarray, rope: tuple) -> None:
    """The recorded pre-RoPE queries, rotated by the recorded RoPE, give the queries that
    the attention received (else the RoPE is not the rotate-half one kvsim knows)."""
    if pre.shape != post.shape or 2 * rope[0].shape[0] > pre.shape[2]:
        raise KvsimError(f"capture: layer {layer}: expected queries before RoPE shaped "
                         f"{post.shape} with at most {post.shape[2] // 2} RoPE frequencies, "
                         f"got {pre.shape} and {rope[0].shape[0]}")
    worst = float(np.abs(rotate(pre, rope[0], rope[1]) - post).max())
    bound = ROPE_TOLERANCE * max(float(np.abs(post).max()), 1e-30)
    if not worst <= bound:
        raise KvsimError(f"capture: layer {layer}: the queries before RoPE, rotated by the "
                         f"model's inverse frequencies (rotate-half layout), miss the queries "
                         f"the attention receives (max deviation {worst:.2e} > {bound:.2e})")


def _replayed(q: np.ndarray, k: np.ndarray, scaling: float, window: int = 0) -> np.ndarray:
    """(H, T, T) causal softmax of one layer's stored vectors (float64), within ``window``
    keys (``t - window < s <= t``) on a sliding-window layer."""
    q = q.astype(np.float64)
    k = np.repeat(k.astype(np.float64), q.shape[0] // k.shape[0], axis=0)
    logits = (q @ k.transpose(0, 2, 1)) * scaling  # BLAS: every layer of a model is checked
    T = q.shape[1]
    visible = np.tri(T, dtype=bool)
    if window:
        visible &= ~np.tri(T, k=-window, dtype=bool)
    logits = np.where(visible, logits, -np.inf)
    p = np.exp(logits - logits.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


def replayed_weights(trace: dict, layer_index: int) -> np.ndarray:
    """(H, T, T) causal (and windowed) softmax of the stored vectors of one recorded layer
    (float64)."""
    return _replayed(trace["queries"][layer_index], trace["keys"][layer_index],
                     float(trace["scaling"]), _window(trace, layer_index))


def _window(trace: dict, layer_index: int) -> int:
    """The sliding window of a recorded layer (0: global, as in a version-1 trace)."""
    return int(trace["windows"][layer_index]) if "windows" in trace else 0


def _deviation(q: np.ndarray, k: np.ndarray, scaling: float, weights: np.ndarray,
               window: int = 0) -> float:
    return float(np.abs(_replayed(q, k, scaling, window) - weights).max())


def _within_tolerance(worst: float) -> float:
    if worst > TOLERANCE:
        raise KvsimError(f"capture: the stored vectors do not reproduce the model's attention "
                         f"(max deviation {worst:.2e} > {TOLERANCE:g})")
    return worst


def check(trace: dict, model_weights: np.ndarray) -> float:
    """Largest deviation of the replayed attention from the model's; error above tolerance."""
    return _within_tolerance(max(
        _deviation(trace["queries"][i], trace["keys"][i], float(trace["scaling"]),
                   model_weights[i], _window(trace, i)) for i in range(model_weights.shape[0])))


def _library_versions() -> dict:
    """The versions of torch and transformers that ran the model (a trace's numbers depend
    on their kernels)."""
    torch, transformers = _imports()
    return {"torch": torch.__version__, "transformers": transformers.__version__}


def capture(model: str, text: Path, tokens: int, out: Path, layers: list[int] | None = None,
            gguf_file: str | None = None, dtype=np.float16) -> Path:
    """Tokenise ``text``, record a trace of its first ``tokens`` tokens (vectors as
    ``dtype``), save it atomically."""
    from kvsim.texts import shipped_text

    text = shipped_text(str(text)) or text
    try:
        raw = read_text(text)
    except ValueError as exc:
        raise KvsimError(f"--text: expected a readable UTF-8 text file ({exc})") from None
    net, tokenizer = load_model(model, gguf_file)
    ids = np.asarray(tokenizer(raw)["input_ids"], np.int64)
    if ids.size < tokens:
        raise KvsimError(f"--tokens: expected at most the text's {ids.size} tokens, got {tokens}")
    trace = record(net, ids[:tokens], layers, dtype)
    meta = {"model": model, "gguf_file": gguf_file, "layers": trace["layers"].tolist(),
            "windows": trace["windows"].tolist(),
            "heads": int(trace["queries"].shape[1]), "kv_heads": int(trace["keys"].shape[1]),
            "head_dim": int(trace["queries"].shape[3]), "tokens": tokens,
            "text_sha256": hashlib.sha256(raw.encode()).hexdigest(),
            "kvsim": __version__, "capture_version": CAPTURE_VERSION,
            "rope_layout": "rotate_half", **_library_versions()}
    if catalog.preset(model) is not None:  # Gemma's weights are not Apache: say so in the trace
        meta["licence"] = catalog.preset(model).licence
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")
    write_npz(tmp, {"meta": np.array(json.dumps(meta)), **trace}, level=6)
    os.replace(tmp, out)
    return out
