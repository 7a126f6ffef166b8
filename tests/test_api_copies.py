"""What the API copies: trusted and checked arrays given to ``simulate`` are read in place,
never copied; an ``Attention`` copies its input once, when built, and never again. Results
are the same on every path."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from matrices import make_attention

import kvsim
from kvsim.api import attention as api_attention

T = 512  # a 2 MB matrix: a copy of it stands far above the call's other allocations
KW = dict(policies=["h2o", "tova", "window"], budgets=[32, 64], prompt_len=256, workers=1)


def _peak_bytes(fn) -> int:
    """Peak bytes allocated (Python and NumPy) while ``fn()`` runs."""
    fn()  # compile and fill caches first
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def A():
    return make_attention(T, "softmax", 0)


@pytest.mark.parametrize("check", [False, True])
def test_simulate_reads_an_array_in_place(A, check, monkeypatch):
    seen = []
    dense = api_attention.dense_field
    monkeypatch.setattr(api_attention, "dense_field",
                        lambda stack, kv: seen.append(stack) or dense(stack, kv))
    kvsim.simulate(A, "h2o", 64, 256, check=check)
    kvsim.simulate(A, check=check, **KW)
    assert len(seen) == 2 and all(np.shares_memory(s, A) for s in seen)
    assert _peak_bytes(lambda: kvsim.simulate(A, check=check, **KW)) < A.nbytes / 2


def test_an_attention_copies_once_when_built_and_never_again(A):
    assert _peak_bytes(lambda: kvsim.Attention.from_probs(A, check=False)) >= A.nbytes
    att = kvsim.Attention.from_probs(A)
    held = att.field().data.probs
    assert not np.shares_memory(held, A)
    assert _peak_bytes(lambda: kvsim.simulate(att, **KW)) < A.nbytes / 2
    assert att.field().data.probs is held


def test_every_path_gives_the_same_results(A):
    trusted = kvsim.simulate(A, check=False, **KW).to_csv()
    assert kvsim.simulate(A, **KW).to_csv() == trusted
    assert kvsim.simulate(kvsim.Attention.from_probs(A), **KW).to_csv() == trusted
    one = kvsim.simulate(A, "h2o", 64, 256, check=False)
    assert np.array_equal(one.mass, kvsim.simulate(A.copy(), "h2o", 64, 256).mass)


def test_a_checked_call_that_renormalises_leaves_the_callers_array_alone(A):
    B = A * (1 + 3e-6)
    before = B.copy()
    res = kvsim.simulate(B, "h2o", 64, 256)
    assert np.array_equal(B, before)
    assert np.allclose(res.mass, kvsim.simulate(A, "h2o", 64, 256).mass, rtol=0, atol=1e-12)
