"""NumPy transcriptions of the authors' PyTorch arithmetic, tensor operation by tensor
operation (shapes, softmax dimensions, pooling and padding, masks as their code does them),
so that tests check kvsim's rule against what the authors' code computes, not only the
kernel against kvsim's own reference.

- R-KV, ``rkv/compression/r1_kv.py`` and ``rkv/utils.py`` at commit d15c976;
- DropKV, kvpress pull request 285, revision 1 (``dropkv_press.py``);
- ChunkKV, kvpress ``chunkkv_press.py`` and ``snapkv_press.py`` at commit 8bb29b9.

Tensors are float64 NumPy arrays with the code's layouts: queries (1, H, q_len, d), keys
and values (1, H_kv, n, d). Where the code calls ``topk``, the transcriptions rank by
score, ties to the lower index (torch leaves their order unspecified).
"""

from __future__ import annotations

import math

import numpy as np


def softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def pool1d(x, kernel, mode):
    """``F.max_pool1d`` / ``F.avg_pool1d`` over the last axis, stride 1, padding
    ``kernel // 2``: max pads with -inf, avg pads with 0 and divides by the kernel."""
    half = kernel // 2
    fill = -np.inf if mode == "max" else 0.0
    padded = np.concatenate([np.full(x.shape[:-1] + (half,), fill), x,
                             np.full(x.shape[:-1] + (half,), fill)], axis=-1)
    windows = np.stack([padded[..., i:i + x.shape[-1]] for i in range(kernel)], axis=-1)
    return windows.max(axis=-1) if mode == "max" else windows.sum(axis=-1) / kernel


def topk_indices(scores, k):
    """The indices of the k largest of a 1-D array (ties: lower index first)."""
    return np.argsort(-scores, kind="stable")[:k]


def repeat_kv(x, n_rep):
    """transformers' ``repeat_kv``: (1, H_kv, n, d) -> (1, H_kv * n_rep, n, d)."""
    return np.repeat(x, n_rep, axis=1)


# ---------------------------------------------------------------- R-KV (d15c976)


def rkv_attention_scores(query_states, key_states):
    """``compute_attention_scores(..., pooling="max")``: q.k / sqrt(d), max over the group."""
    _, H, q_len, d = query_states.shape
    H_kv = key_states.shape[1]
    G = H // H_kv
    if G == 1:
        return query_states @ key_states.transpose(0, 1, 3, 2) / math.sqrt(d)
    q = query_states.reshape(1, H_kv, G, q_len, d)
    k = key_states[:, :, None]
    return (q @ k.transpose(0, 1, 2, 4, 3) / math.sqrt(d)).max(axis=2)


def rkv_similarity(key_states, threshold=0.5):
    """``cal_similarity(..., retain_direction="last")``: the softmax of the column means of
    the masked cosine matrix, per KV head."""
    k = key_states[0]
    k_norm = k / (np.linalg.norm(k, axis=-1, keepdims=True) + 1e-8)
    sim = k_norm @ k_norm.transpose(0, 2, 1)
    for h in range(sim.shape[0]):
        np.fill_diagonal(sim[h], 0.0)
    mask = sim > threshold
    n = mask.shape[-1]
    indices = np.where(mask, np.arange(n), 0)
    retain = indices.max(axis=-1)  # the last True index of each row (0 when none)
    heads = np.arange(sim.shape[0])[:, None].repeat(n, axis=1)
    rows = np.arange(n)[None, :].repeat(sim.shape[0], axis=0)
    sim[heads, rows, retain] = 0.0
    return softmax(sim.mean(axis=1), axis=-1)


def rkv_update_kv(query_states, key_states, budget, window_size=8, kernel_size=7,
                  mix_lambda=0.07):
    """``R1KV.update_kv``: per KV head, the cache indices it keeps (the kept older ones in
    the order ``topk`` returns them, then the window), or None when it does not compress."""
    n = key_states.shape[-2]
    if n < budget:
        return None
    attn = rkv_attention_scores(query_states, key_states)
    attn_sum = softmax(attn[:, :, -window_size:, :-window_size], axis=-1).mean(axis=-2)
    attn_cache = pool1d(attn_sum, kernel_size, "max")
    similarity = rkv_similarity(key_states)[:, :-window_size]
    final = attn_cache * mix_lambda - similarity * (1 - mix_lambda)
    return [np.concatenate([topk_indices(final[0, h], budget - window_size),
                            np.arange(n - window_size, n)]) for h in range(final.shape[1])]


# ---------------------------------------------------------------- DropKV (PR 285 rev. 1)


def dropkv_scores(query_states, keys, values, window_size=32, kernel_size=7, epsilon=1e-6):
    """``DropKVPress.score`` (window queries recomputed, not taken from eager attention):
    the expanded residual ``a - b + c``, the group mean, average pooling, then the window
    protected with the maximum + 1. Returns the pooled scores, the protected scores and
    the pooled size of the terms ``a + |b| + c`` (the expansion's rounding scales with it)."""
    _, H, q_len, d = query_states.shape
    _, H_kv, n, _ = keys.shape
    w = max(1, min(window_size, q_len, n))
    q = query_states[:, :, -w:]
    G = H // H_kv
    weights = q @ repeat_kv(keys, G).transpose(0, 1, 3, 2) / math.sqrt(d)
    weights = weights + np.triu(np.full((w, n), -np.inf), k=n - w + 1)
    probs = softmax(weights, axis=-1)
    rep_v = repeat_kv(values, G)
    output = probs @ rep_v
    sens = np.square(probs / (1.0 - probs + epsilon))
    term_a = sens.sum(axis=-2) * np.square(rep_v).sum(axis=-1)
    weighted = sens.transpose(0, 1, 3, 2) @ output
    term_b = 2.0 * (rep_v * weighted).sum(axis=-1)
    term_c = (sens.transpose(0, 1, 3, 2) @ np.square(output).sum(axis=-1)[..., None])[..., 0]
    scores = (term_a - term_b + term_c).reshape(1, H_kv, G, n).mean(axis=2)
    scores = pool1d(scores, kernel_size, "avg")
    size = pool1d((term_a + np.abs(term_b) + term_c).reshape(1, H_kv, G, n).mean(axis=2),
                  kernel_size, "avg")
    pooled = scores.copy()
    scores[:, :, -w:] = scores.max(axis=-1, keepdims=True) + 1.0
    return pooled, scores, size


# ---------------------------------------------------------------- ChunkKV (8bb29b9)


def snapkv_scores(query_states, keys, window_size=64, kernel_size=5):
    """``SnapKVPress.score``: the window's attention to the older keys, its mean over the
    window, average pooling, the group mean, then the window padded with the max + 1."""
    _, H, _, d = query_states.shape
    _, H_kv, n, _ = keys.shape
    G = H // H_kv
    q = query_states[:, :, -window_size:]
    weights = q @ repeat_kv(keys, G).transpose(0, 1, 3, 2) / math.sqrt(d)
    weights = weights + np.triu(np.full((window_size, n), -np.inf), k=n - window_size + 1)
    attn = softmax(weights, axis=-1)[..., :-window_size]
    scores = pool1d(attn.mean(axis=-2), kernel_size, "avg")
    scores = scores.reshape(1, H_kv, G, n - window_size).mean(axis=2)
    pad = np.full((1, H_kv, window_size), scores.max() + 1.0)
    return np.concatenate([scores, pad], axis=-1)


def chunk_scores(global_scores, chunk_length=20):
    """``ChunkKVPress.compress`` step 2: the scores summed over the KV heads, each complete
    chunk's mean, then the remaining partial chunk's mean."""
    n = global_scores.shape[-1]
    full, rest = n // chunk_length, n % chunk_length
    summed = global_scores.sum(axis=1)
    chunks = summed[:, :full * chunk_length].reshape(summed.shape[0], full, chunk_length)
    chunks = chunks.mean(axis=-1)
    if rest:
        chunks = np.concatenate([chunks, summed[:, -rest:].mean(axis=-1, keepdims=True)],
                                axis=-1)
    return chunks
