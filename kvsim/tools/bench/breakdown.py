"""Where the full pass's time goes: the cost per entry of each of its parts, one thread.

Each part runs alone over the same long rows (queries ``T - rows .. T - 1`` of the bench
field), inside a compiled loop, so the figures are the kernels' own, without Python
overheads, and comparable with the full pass's cost per entry and per core.
"""

from __future__ import annotations

import time

import numpy as np

from kvsim.numerics.jit import jit
from kvsim.numerics.field import FieldData, logits_row
from kvsim.numerics.fullpass import exp_shifted
from kvsim.numerics.lanes import lane_max, lane_sum
from kvsim.numerics.noise import add_noise_row


@jit
def _key_terms(f, q, keys, buf, sums):
    logits_row(f, 0, q, keys, q + 1, buf, sums)  # a field without noise: key and distance terms


@jit
def _noise(f, q, keys, buf, sums):
    add_noise_row(f.noise_kind[0], f.noise_key[0], f.noise_scale[0], q, q + 1, buf)


@jit
def _row_max(f, q, keys, buf, sums):
    sums[0] += lane_max(buf, q + 1)


@jit
def _exp(f, q, keys, buf, sums):
    exp_shifted(buf, 0, q + 1, 100.0)  # the pass's own loop; arguments near -100, all <= 0


@jit
def _row_sum(f, q, keys, buf, sums):
    sums[0] += lane_sum(buf, q + 1)


@jit
def _scale_and_accumulate(f, q, keys, buf, sums):
    scale = 1.0 / (q + 1)
    for k in range(q + 1):
        buf[k] = buf[k] * scale
        sums[k] += buf[k]


@jit
def _run_rows(part, f, first, last, keys, buf, sums):
    for q in range(first, last):
        part(f, q, keys, buf, sums)


PARTS = {"key and distance terms": _key_terms, "Gaussian noise": _noise,
         "row maximum": _row_max, "exp": _exp, "row sum": _row_sum,
         "normalise and add to the column sums": _scale_and_accumulate}


def breakdown(noisy: FieldData, plain: FieldData, rows: int = 32) -> dict[str, float]:
    """Nanoseconds per entry of each part on one thread (``noisy``: the field with Gaussian
    noise; ``plain``: the same without)."""
    T = plain.T
    keys = np.arange(T)
    buf = np.full(T, -1.0)
    sums = np.zeros(T)
    entries = sum(q + 1 for q in range(T - rows, T))
    out = {}
    for name, part in PARTS.items():
        field = noisy if part is _noise else plain
        _run_rows(part, field, T - 2, T, keys, buf, sums)  # compile and warm up
        start = time.perf_counter()
        _run_rows(part, field, T - rows, T, keys, buf, sums)
        out[name] = (time.perf_counter() - start) / entries * 1e9
    return out
