"""KIVI storage (Liu et al. 2024; jy-yuan/KIVI at ``876b4d2``): the cache's keys quantised
per channel and its values per token, and the metrics of attention over them.

At step ``t`` the cache holds ``n`` keys in position order. Keys in slots
``< R * floor((n - 1) / R)`` are quantised per channel (each dimension) in groups of
``G`` slots; values in slots ``< n - 1 - R`` per token in groups of ``G`` channels; the
rest stay exact. A group with minimum ``lo`` and maximum ``hi`` stores codes
``round_half_even(clip((x - lo) / s, 0, 2^b - 1))``, ``s = (hi - lo) / (2^b - 1)``, and
reads back ``code * s + lo`` (a constant group, ``s = 0``, reads back ``lo``).

Query ``t`` attends over the quantised keys, ``p~ = softmax(l~)`` over the cache (``l~``:
the field's logit with ``k~`` in the ``q.k`` term), and its output is ``o~ = sum p~ v~``.
The step's *mass* is ``exp(-KL(p~ || p))`` against the full attention ``p`` of the exact
cache: with exact keys it is the kept mass ``sum_{k in C} p(t, k)``, so quantised and
evicting caches are measured alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kvsim.numerics.field import logits_at
from kvsim.numerics.jit import jit


@dataclass(frozen=True)
class Quantize:
    """KIVI settings: ``bits`` per code, ``group`` size, ``residual`` newest tokens exact."""

    bits: int = 2
    group: int = 32
    residual: int = 32


@jit
def dequantised(x, lo, hi, levels):
    """``x`` through a group with minimum ``lo`` and maximum ``hi`` at ``levels`` (2^b - 1)."""
    s = (hi - lo) / levels
    if s == 0.0:
        return lo
    return np.rint(min(max((x - lo) / s, 0.0), levels)) * s + lo


@jit
def quantise_groups(a, rows, cols, bits, group):
    """In place: for each row ``< rows``, the groups of ``group`` consecutive columns
    ``< cols`` (``cols`` a multiple of ``group``). Keys ``(d, n)``: every channel, the first
    slots (per channel); values ``(n, dv)``: the first tokens, every channel (per token)."""
    levels = 2.0 ** bits - 1.0
    for r in range(rows):
        for start in range(0, cols, group):
            lo = a[r, start]
            hi = a[r, start]
            for j in range(start, start + group):
                lo = min(lo, a[r, j])
                hi = max(hi, a[r, j])
            for j in range(start, start + group):
                a[r, j] = dequantised(a[r, j], lo, hi, levels)


def quantised_counts(n: int, residual: int) -> tuple[int, int]:
    """(quantised keys, quantised values) of a cache of ``n`` tokens."""
    return residual * ((n - 1) // residual) if n > 0 else 0, max(n - 1 - residual, 0)


@jit
def quantised_steps(f, row_max, row_sum, heads, prompt_len, snapshots, keys, values, bits,
                    group, residual, full_output, mass, error):
    """``mass[g, s]`` and ``error[g, s]`` of every decode step ``s`` whose cache (positions,
    -1 padded) is ``snapshots[s]``, over KIVI-quantised keys ``keys`` (d, T) and values
    ``values`` (T, dv) of the KV head."""
    d, dv = keys.shape[0], values.shape[1]
    width = snapshots.shape[1]
    cache = np.empty(width, np.int64)
    exact = np.empty((d, width))
    kq = np.empty((d, width))
    vq = np.empty((width, dv))
    lq = np.empty(width)
    le = np.empty(width)
    work = np.empty(width)
    out = np.empty(dv)
    for s in range(snapshots.shape[0]):
        t = prompt_len + s
        n = 0
        for j in range(width):
            if snapshots[s, j] >= 0:
                cache[n] = snapshots[s, j]
                n += 1
        cache[:n] = np.sort(cache[:n])
        for j in range(n):
            for i in range(d):
                exact[i, j] = keys[i, cache[j]]
                kq[i, j] = keys[i, cache[j]]
            for i in range(dv):
                vq[j, i] = values[cache[j], i]
        nk = residual * ((n - 1) // residual) if n > 0 else 0
        quantise_groups(kq, d, nk, bits, group)
        quantise_groups(vq, max(n - 1 - residual, 0), dv, bits, group)
        for g in range(heads.shape[0]):
            h = heads[g]
            logits_at(f, h, t, cache, n, lq, work, kq[:, :n])
            logits_at(f, h, t, cache, n, le, work, exact[:, :n])
            top = lq[0]
            for j in range(1, n):
                top = max(top, lq[j])
            total = 0.0
            for j in range(n):
                total += math.exp(lq[j] - top)
            log_norm = top + math.log(total)
            log_full = row_max[h, t] + math.log(row_sum[h, t])
            kl = 0.0
            for i in range(dv):
                out[i] = 0.0
            for j in range(n):
                log_q = lq[j] - log_norm
                w = math.exp(log_q)
                kl += w * (log_q - (le[j] - log_full))
                for i in range(dv):
                    out[i] += w * vq[j, i]
            mass[g, s] = math.exp(-kl)
            if dv > 0:
                diff = 0.0
                norm = 0.0
                for i in range(dv):
                    diff += (out[i] - full_output[g, s, i]) ** 2
                    norm += full_output[g, s, i] ** 2
                error[g, s] = math.sqrt(diff / norm) if norm > 0.0 else 0.0


def cache_bytes(sizes: np.ndarray, d: int, dv: int, quant: Quantize | None) -> np.ndarray:
    """Bytes of one KV head's cache at each cache size: 2 per exact element (16 bits);
    under KIVI, the quantised elements' codes packed (``bits`` each, rounded up to whole
    bytes for keys and for values) and 4 per group (its 16-bit scale and minimum)."""
    sizes = np.asarray(sizes, np.int64)
    if quant is None:
        return (2 * sizes * (d + dv)).astype(np.float64)
    out = np.empty(sizes.shape[0])
    for i, n in enumerate(sizes.tolist()):
        nk, nv = quantised_counts(n, quant.residual)
        key_bytes = -(-nk * d * quant.bits // 8) + 4 * (nk // quant.group) * d + 2 * (n - nk) * d
        value_bytes = -(-nv * dv * quant.bits // 8) + 4 * nv * (dv // quant.group) \
            + 2 * (n - nv) * dv
        out[i] = key_bytes + value_bytes
    return out
