"""Record the post-RoPE queries, keys and values of a Hugging Face causal LM (``kvsim capture``).

The model runs once on the CPU with eager attention. A wrapper around the model's own
eager attention function records, for each chosen layer, the query, key and value
tensors it receives (after rotary embedding, before any KV repetition) and the
attention weights it returns; before saving, the trace is checked: the causal softmax
of ``q . k * scaling`` recomputed from the stored float16 vectors must reproduce those
weights to float16 precision. Needs the optional extra: ``pip install -e ".[capture]"``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError

TOLERANCE = 2e-3  # max |p_replayed - p_model| allowed: float16 vectors, float32 model


def _imports():
    try:
        import torch
        import transformers
    except ImportError:
        raise KvsimError('capture needs torch and transformers: pip install -e ".[capture]"') \
            from None
    return torch, transformers


def load_model(model: str, gguf_file: str | None = None):
    """(model, tokenizer) from a local directory or a cached hub id, eager attention, float32.

    Never downloads: a model that is not on disk is a one-line :class:`KvsimError`.
    """
    torch, transformers = _imports()
    kwargs = {"local_files_only": True}
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model, **kwargs)
        net = transformers.AutoModelForCausalLM.from_pretrained(
            model, attn_implementation="eager", dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvsimError(f"--model: expected a model on disk ({model}"
                         f"{', ' + gguf_file if gguf_file else ''}): {first}") from None
    return net.eval(), tokenizer


def record(net, token_ids: np.ndarray, layers: list[int] | None = None) -> dict:
    """Run ``net`` on ``token_ids`` and return the trace arrays of the chosen layers."""
    torch, _ = _imports()
    n_layers = net.config.num_hidden_layers
    layers = list(range(n_layers)) if layers is None else layers
    if any(not 0 <= layer < n_layers for layer in layers):
        raise KvsimError(f"--layers: expected layer indices in [0, {n_layers}), got {layers}")
    attn_module = sys.modules[type(net.model.layers[0].self_attn).__module__]
    original = attn_module.eager_attention_forward
    seen: dict = {}

    def recording(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
        output, weights = original(module, query, key, value, attention_mask, scaling,
                                   dropout=dropout, **kwargs)
        if module.layer_idx in layers:
            seen[module.layer_idx] = (query[0].detach(), key[0].detach(), value[0].detach(),
                                      weights[0].detach(), float(scaling))
        return output, weights

    attn_module.eager_attention_forward = recording
    try:
        with torch.no_grad():
            net(torch.as_tensor(token_ids[None], dtype=torch.long))
    finally:
        attn_module.eager_attention_forward = original
    missing = [layer for layer in layers if layer not in seen]
    if missing:
        raise KvsimError(f"capture: the model's eager attention was not called for layers "
                         f"{missing}; is it a supported causal LM?")
    q, k, v, w, scale = zip(*(seen[layer] for layer in layers))
    trace = {"queries": torch.stack(q).numpy().astype(np.float16),
             "keys": torch.stack(k).numpy().astype(np.float16),
             "values": torch.stack(v).numpy().astype(np.float16),
             "layers": np.array(layers, np.int64), "scaling": np.array(scale[0]),
             "token_ids": np.asarray(token_ids, np.int64)}
    check(trace, np.stack([x.numpy() for x in w]))
    return trace


def replayed_weights(trace: dict, layer_index: int) -> np.ndarray:
    """(H, T, T) causal softmax of the stored vectors of one recorded layer (float64)."""
    q = trace["queries"][layer_index].astype(np.float64)
    k = trace["keys"][layer_index].astype(np.float64)
    k = np.repeat(k, q.shape[0] // k.shape[0], axis=0)
    logits = np.einsum("hqd,hkd->hqk", q, k) * float(trace["scaling"])
    T = q.shape[1]
    logits = np.where(np.tri(T, dtype=bool), logits, -np.inf)
    p = np.exp(logits - logits.max(axis=2, keepdims=True))
    return p / p.sum(axis=2, keepdims=True)


def check(trace: dict, model_weights: np.ndarray) -> float:
    """Largest deviation of the replayed attention from the model's; error above tolerance."""
    worst = max(float(np.abs(replayed_weights(trace, i) - model_weights[i]).max())
                for i in range(model_weights.shape[0]))
    if worst > TOLERANCE:
        raise KvsimError(f"capture: the stored vectors do not reproduce the model's attention "
                         f"(max deviation {worst:.2e} > {TOLERANCE:g})")
    return worst


def capture(model: str, text: Path, tokens: int, out: Path, layers: list[int] | None = None,
            gguf_file: str | None = None) -> Path:
    """Tokenise ``text``, record a trace of its first ``tokens`` tokens, save it atomically."""
    import kvsim

    try:
        raw = text.read_text(encoding="utf-8")
    except OSError as exc:
        raise KvsimError(f"--text: expected a readable text file ({exc})") from None
    net, tokenizer = load_model(model, gguf_file)
    ids = np.asarray(tokenizer(raw)["input_ids"], np.int64)
    if ids.size < tokens:
        raise KvsimError(f"--tokens: expected at most the text's {ids.size} tokens, got {tokens}")
    trace = record(net, ids[:tokens], layers)
    meta = {"model": model, "gguf_file": gguf_file, "layers": trace["layers"].tolist(),
            "heads": int(trace["queries"].shape[1]), "kv_heads": int(trace["keys"].shape[1]),
            "head_dim": int(trace["queries"].shape[3]), "tokens": tokens,
            "text_sha256": hashlib.sha256(raw.encode()).hexdigest(),
            "kvsim": kvsim.__version__}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, meta=np.array(json.dumps(meta)), **trace)
    os.replace(tmp, out)
    return out
