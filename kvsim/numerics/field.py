"""An attention field as Numba-ready arrays, and the exact logit and probability of one entry.

A field holds, for ``H`` query heads over ``T`` positions, either dense probabilities
or the components that define a logit ``l(h, q, k)`` on the fly (O(T) memory per
head, O(T d) for query/key vectors). Every probability kvsim uses is
``exp(l - row_max[h, q]) * (1 / row_sum[h, q])`` with the row statistics of the full pass
(``exp`` being :func:`kvsim.numerics.elementary.exp_nonpositive`),
so one formula serves the full pass, the policies and the metrics (bit for bit).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvsim.numerics.jit import jit, jit_inline
from kvsim.numerics.elementary import exp_nonpositive
from kvsim.numerics.noise import add_noise, add_noise_span


class FieldData(NamedTuple):
    """Arrays defining the attention of ``H`` query heads (shapes in comments)."""

    probs: np.ndarray           # (H, T, T) float64 dense probabilities, or (H, 0, 0)
    key_bias: np.ndarray        # (H, T) float64: sinks, heavy hitters (key-only terms)
    distance: np.ndarray        # (H, T) float64: recency term by distance q - k
    boost_head: np.ndarray      # (nb,) int64: query head of each boost
    boost_rows: np.ndarray      # (nb, 2) int64: query range [lo, hi)
    boost_keys: np.ndarray      # (nb, T) bool: boosted keys
    boost_strength: np.ndarray  # (nb,) float64
    noise_kind: np.ndarray      # (H,) int64
    noise_scale: np.ndarray     # (H,) float64
    noise_key: np.ndarray       # (H,) uint64: counter-hash key of (seed, head)
    queries: np.ndarray         # (H, T, d) float32, or (H, 0, 0)
    keys: np.ndarray            # (H_kv, d, T) float32 by dimension, or (H_kv, 0, 0)
    values: np.ndarray          # (H_kv, T, dv) float32, or (H_kv, 0, 0)
    value_heads: np.ndarray     # (H_kv,) bool: which KV heads have values
    qk_scale: np.ndarray        # (H,) float64: multiplies q.k (0: no qk term)
    group: int                  # query heads per KV head
    pre_rope_queries: np.ndarray  # (H, T, d) float32 queries before RoPE, or (H, 0, 0)
    rope_freq: np.ndarray       # (d_rot / 2,) float64 RoPE inverse frequencies, or (0,)
    rope_scale: float           # RoPE's cos/sin factor (1: plain rotation)

    @property
    def heads(self) -> int:
        return self.key_bias.shape[0]

    @property
    def T(self) -> int:
        return self.key_bias.shape[1]

    @property
    def is_dense(self) -> bool:
        return self.probs.shape[1] > 0

    def has_values(self, kv_head: int) -> bool:
        """Whether KV head ``kv_head`` has value vectors (for the output error)."""
        return bool(self.value_heads[kv_head])


def empty_field(heads: int, T: int, kv_heads: int | None = None) -> dict:
    """Keyword arguments of a :class:`FieldData` with every component off."""
    kv_heads = heads if kv_heads is None else kv_heads
    return dict(
        probs=np.zeros((heads, 0, 0)), key_bias=np.zeros((heads, T)),
        distance=np.zeros((heads, T)), boost_head=np.zeros(0, np.int64),
        boost_rows=np.zeros((0, 2), np.int64), boost_keys=np.zeros((0, T), bool),
        boost_strength=np.zeros(0), noise_kind=np.zeros(heads, np.int64),
        noise_scale=np.zeros(heads), noise_key=np.zeros(heads, np.uint64),
        queries=np.zeros((heads, 0, 0), np.float32), keys=np.zeros((kv_heads, 0, 0), np.float32),
        values=np.zeros((kv_heads, 0, 0), np.float32), value_heads=np.zeros(kv_heads, bool),
        qk_scale=np.zeros(heads),
        group=heads // kv_heads, pre_rope_queries=np.zeros((heads, 0, 0), np.float32),
        rope_freq=np.zeros(0), rope_scale=1.0)


def dense_field(probs: np.ndarray, kv_heads: int | None = None) -> FieldData:
    """A field over checked float64 probabilities of shape (H, T, T)."""
    fields = empty_field(probs.shape[0], probs.shape[1], kv_heads)
    fields["probs"] = np.ascontiguousarray(probs, dtype=np.float64)
    return FieldData(**fields)


@jit_inline
def _add_boosts(f, h, q, keys, lo, hi, out):
    for b in range(f.boost_strength.shape[0]):
        if f.boost_head[b] == h and f.boost_rows[b, 0] <= q < f.boost_rows[b, 1]:
            for j in range(lo, hi):
                if f.boost_keys[b, keys[j]]:
                    out[j] += f.boost_strength[b]


_NO_CACHE = np.zeros((0, 0))  # no cached key vectors: read them from the field


@jit_inline
def _add_qk(f, h, q, keys, lo, hi, out, work, cached, whole_row):
    """Add ``qk_scale * q.k`` for ``keys[lo:hi]``, the dot product summed over dimensions
    in order (the same sum on every path). Keys are stored by dimension, so each dimension
    is one loop over the keys: over ``cached`` (d, n) copies of the cached keys' vectors if
    given, contiguous for a whole row, gathered otherwise. ``work[lo:hi]`` holds the sums."""
    if f.qk_scale[h] != 0.0:
        kv = h // f.group
        sums, span = work[lo:hi], out[lo:hi]  # indices from 0: LLVM then vectorises
        for j in range(hi - lo):
            sums[j] = 0.0
        for i in range(f.keys.shape[1]):
            qi = np.float64(f.queries[h, q, i])
            if cached.shape[0] > 0:
                copies = cached[i, lo:hi]  # row views: LLVM then vectorises over the keys
                for j in range(hi - lo):
                    sums[j] += qi * copies[j]
            elif whole_row:
                dim = f.keys[kv, i, lo:hi]
                for j in range(hi - lo):
                    sums[j] += qi * dim[j]
            else:
                dim = f.keys[kv, i]
                for j in range(lo, hi):
                    sums[j - lo] += qi * dim[keys[j]]
        for j in range(hi - lo):
            span[j] += f.qk_scale[h] * sums[j]


@jit_inline
def logits_at(f, h, q, keys, n, out, work, cached):
    """Logits of query ``q`` in head ``h`` of a component field for ``keys[:n]`` into ``out``.

    Each component (key and distance terms, boosts, noise, q.k) is one loop over the keys,
    added in that order; :func:`logits_row` gives the same numbers for a whole row.
    ``work`` is scratch for ``n`` floats; ``cached`` is an optional (d, n) float64 copy of
    the keys' vectors ((0, 0) if none), which the decode loop keeps with its cache.
    """
    for j in range(n):
        k = keys[j]
        out[j] = f.key_bias[h, k] + f.distance[h, q - k]
    _add_boosts(f, h, q, keys, 0, n, out)
    add_noise(f.noise_kind[h], f.noise_key[h], f.noise_scale[h], q, keys, n, out)
    _add_qk(f, h, q, keys, 0, n, out, work, cached, False)


@jit_inline
def logits_span(f, h, q, keys, lo, hi, out, work):
    """:func:`logits_at` for keys ``lo .. hi-1`` of a row (``keys`` holds ``0 .. T-1``,
    ``lo`` even) into ``out[lo:hi]``: contiguous reads, and noise that shares work between
    neighbouring keys. The full pass runs a row span by span, so that each span stays in
    cache while every term is added to it."""
    bias, span = f.key_bias[h, lo:hi], out[lo:hi]  # indices from 0: LLVM then vectorises
    distance = f.distance[h]
    for j in range(hi - lo):
        span[j] = bias[j] + distance[q - lo - j]
    _add_boosts(f, h, q, keys, lo, hi, out)
    add_noise_span(f.noise_kind[h], f.noise_key[h], f.noise_scale[h], q, lo, hi, out)
    _add_qk(f, h, q, keys, lo, hi, out, work, _NO_CACHE, True)


@jit
def logits_row(f, h, q, keys, n, out, work):
    """:func:`logits_span` for keys ``0 .. n-1``. A kernel of its own, so that the kernels
    that only need rows, or only cached keys, compile only what they use."""
    logits_span(f, h, q, keys, 0, n, out, work)


@jit_inline
def _exp_scaled(f, row_max, row_sum, h, q, n, out):
    """``out[:n] = exp(out - row_max) * (1 / row_sum)``: logits to probabilities."""
    top = row_max[h, q]
    scale = 1.0 / row_sum[h, q]  # a multiply per key: a division costs ten times more
    for j in range(n):
        out[j] = exp_nonpositive(out[j] - top) * scale


@jit
def component_probs_at(f, row_max, row_sum, h, q, keys, n, out, work, cached):
    """:func:`probs_at` of a component field, ``exp(l - row_max) * (1 / row_sum)``: one
    kernel that every decode loop calls, not inlined into each (Numba's inlining of the
    logit code was about a quarter of a loop's compilation)."""
    logits_at(f, h, q, keys, n, out, work, cached)
    _exp_scaled(f, row_max, row_sum, h, q, n, out)


@jit_inline
def probs_at(f, row_max, row_sum, h, q, keys, n, out, work, cached):
    """Full attention ``p(q, k)`` of head ``h`` for ``keys[:n]`` into ``out`` (``work`` and
    ``cached`` as for :func:`logits_at`): dense fields read their matrix, component fields
    call :func:`component_probs_at`."""
    if f.probs.shape[1] > 0:
        for j in range(n):
            out[j] = f.probs[h, q, keys[j]]
        return
    component_probs_at(f, row_max, row_sum, h, q, keys, n, out, work, cached)


@jit_inline
def component_probs_row(f, row_max, row_sum, h, q, keys, n, out, work):
    """:func:`probs_row` of a component field."""
    logits_row(f, h, q, keys, n, out, work)
    _exp_scaled(f, row_max, row_sum, h, q, n, out)


@jit
def probs_row(f, row_max, row_sum, h, q, keys, n, out, work):
    """:func:`probs_at` for keys ``0 .. n-1`` (``keys`` holds them)."""
    if f.probs.shape[1] > 0:
        for k in range(n):
            out[k] = f.probs[h, q, k]
        return
    component_probs_row(f, row_max, row_sum, h, q, keys, n, out, work)
