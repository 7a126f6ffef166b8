"""The full pass sweeps each row span by span (kvsim.numerics.fullpass.SPAN keys at a time):
it must give, bit for bit, what the whole-row functions give one after another."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.attention import components
from kvsim.numerics.field import logits_row
from kvsim.numerics.fullpass import SPAN, exp_shifted, full_pass
from kvsim.numerics.lanes import lane_max, lane_sum


def whole_rows(field, h: int, prompt_len: int):
    """Row statistics, column sums and decode mass row by row, each step over the whole row."""
    T = field.T
    keys, buf, work = np.arange(T), np.empty(T), np.empty(T)
    row_max, row_sum = np.zeros(T), np.ones(T)
    mass = np.zeros(T - prompt_len)
    blocks = np.zeros((16, 2, T))  # the pass's own grouping of rows: q % 16, in row order
    for q in range(T):
        n = q + 1
        logits_row(field, h, q, keys, n, buf, work)
        top = lane_max(buf, n)
        p = buf[:n].copy()
        exp_shifted(p, 0, n, top)  # over the whole row at once
        total = lane_sum(p, n)
        p = p * (1.0 / total)
        row_max[q], row_sum[q] = top, total
        blocks[q % 16, int(q >= prompt_len), :n] += p
        if q >= prompt_len:
            mass[q - prompt_len] = lane_sum(p, n)
    sums = blocks[0].copy()
    for b in range(1, 16):
        sums += blocks[b]
    return row_max, row_sum, sums[0], sums[1], mass


@pytest.mark.parametrize("noise", ["gaussian", "gumbel"])
def test_spans_give_the_whole_row_numbers(noise):
    T = 2 * SPAN + 3  # two whole spans and a short, odd one
    comps = {"sinks": {"count": 4, "strength": 6.0},
             "recency": {"kind": "power", "alpha": 0.8, "tau": 64.0},
             "noise": {"kind": noise, "scale": 0.7},
             "boost": [{"key_positions": [5, 2100], "queries": [3000, T], "strength": 3.0,
                        "keys": [], "important": True}]}
    field = components.build([comps], T, 1, seed=3)[0]
    fp = full_pass(field, 0, T - 40)
    row_max, row_sum, prompt, decode, mass = whole_rows(field, 0, T - 40)
    assert np.array_equal(fp.row_max, row_max)
    assert np.array_equal(fp.row_sum, row_sum)
    assert np.array_equal(fp.prompt_colsum, prompt)
    assert np.array_equal(fp.decode_colsum, decode)
    assert np.array_equal(fp.decode_mass, mass)
