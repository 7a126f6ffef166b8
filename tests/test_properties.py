"""Property tests on kvsim.simulate (hypothesis) and its argument errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from matrices import RECIPES, make_attention

import kvsim
from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def sequences(draw, max_T=24):
    """(attention, T, prompt_len, budget, important, recipe)."""
    T = draw(st.integers(1, max_T))
    P = draw(st.one_of(st.just(0), st.just(T), st.integers(0, T)))
    recipe = draw(st.sampled_from(RECIPES))
    A = make_attention(T, recipe, draw(st.integers(0, 2**31 - 1)))
    B = draw(st.one_of(st.integers(1, 4), st.integers(1, T + 3)))
    important = draw(st.lists(st.integers(0, T - 1), min_size=1, max_size=max(1, T // 2), unique=True))
    return A, T, P, B, np.array(sorted(important), dtype=np.int64), recipe


def budgeted_runs(draw, B, P, T):
    """Policy variants valid for this budget: (name, params) pairs, all budgeted (not `full`)."""
    runs = [
        ("window", {}),
        ("h2o", {"recent_ratio": draw(st.sampled_from([0.0, 0.25, 0.5, 0.9])),
                 "normalize": draw(st.booleans()),
                 "accumulate": draw(st.sampled_from(["observed", "full"]))}),
        ("h2o_offline", {"recent_ratio": draw(st.sampled_from([0.0, 0.5, 0.75]))}),
        ("tova", {}),
        ("random", {"seed": draw(st.integers(0, 10**6))}),
        ("oracle", {}),
    ]
    if B >= 2:
        runs.append(("streaming_llm", {"sinks": draw(st.integers(1, min(4, B - 1)))}))
        runs.append(("snapkv", {"window": draw(st.integers(1, B - 1)),
                                "kernel": draw(st.sampled_from([1, 3, 5, 7])),
                                "pooling": draw(st.sampled_from(["max", "avg", "none"]))}))
    if P == T:
        runs.append(("snapkv", {"window": draw(st.integers(1, 8)), "protect_window": False,
                                "pooling": draw(st.sampled_from(["max", "avg", "none"]))}))
    listed = {name for name, _ in runs}
    return runs + [(name, {}) for name in valid_defaults(B, P, T, budgeted=True)
                   if name not in listed]


def valid_defaults(B, P, T, budgeted=False):
    """Registered policies that run with their defaults at this budget on a dense matrix."""
    names = []
    for name, policy in POLICIES.items():
        params = resolve_params(policy, {})
        if (policy.budgeted or not budgeted) and not policy.needs \
                and B >= policy.min_budget(params) and policy.check(T, P, params) is None:
            names.append(name)
    return names


@SETTINGS
@given(case=sequences(), data=st.data())
def test_invariants(case, data):
    A, T, P, B, important, recipe = case
    steps = T - P
    oracle = kvsim.simulate(A, "oracle", B, P, important=important)
    for policy, params in budgeted_runs(data.draw, B, P, T):
        r = kvsim.simulate(A, policy, B, P, important=important, **params)
        ctx = f"{policy} {params} T={T} P={P} B={B} recipe={recipe}"
        assert r.mass.shape == (steps,) and r.cache_size.shape == (steps,), ctx
        # hard budget at every step; the cache grows by one per step until full
        assert np.all(r.cache_size <= B), ctx
        expected_size = np.minimum(np.arange(P + 1, T + 1), B)
        assert np.array_equal(r.cache_size, expected_size), ctx
        assert np.all(r.mass >= 0) and np.all(r.mass <= 1 + 1e-9), ctx
        # the final cache: sorted, unique, inside [0, T), min(T, B) keys (prefill gives min(P, B))
        assert np.all(np.diff(r.kept) > 0), ctx
        assert np.all((r.kept >= 0) & (r.kept < T)), ctx
        assert len(r.kept) == min(T, B), ctx
        # the oracle keeps the B largest p(t, .): no budgeted cache retains more mass
        assert np.all(oracle.mass >= r.mass - 1e-12), ctx
        # recall is a fraction, NaN only before any important key has arrived
        arrived = np.array([np.any(important <= t) for t in range(P, T)], dtype=bool)
        assert np.array_equal(~np.isnan(r.recall), arrived), ctx
        assert np.all((r.recall[arrived] >= 0) & (r.recall[arrived] <= 1)), ctx
        assert 0 <= r.final_recall <= 1, ctx


@SETTINGS
@given(case=sequences())
def test_full_keeps_everything(case):
    A, T, P, B, important, _ = case
    r = kvsim.simulate(A, "full", B, P, important=important)
    np.testing.assert_allclose(r.mass, 1.0, rtol=0, atol=1e-9)
    assert np.array_equal(r.cache_size, np.arange(P + 1, T + 1))
    assert np.array_equal(r.kept, np.arange(T))
    assert np.all(r.recall[~np.isnan(r.recall)] == 1.0)
    assert r.final_recall == 1.0


@SETTINGS
@given(case=sequences(), data=st.data())
def test_deterministic(case, data):
    A, T, P, B, important, _ = case
    runs = budgeted_runs(data.draw, B, P, T) + [("full", {})]
    for policy, params in runs:
        a = kvsim.simulate(A, policy, B, P, important=important, **params)
        b = kvsim.simulate(A.copy(), policy, B, P, important=important.copy(), **params)
        for field in ("mass", "cache_size", "recall", "kept"):
            assert np.array_equal(getattr(a, field), getattr(b, field), equal_nan=field != "kept"), (policy, field)
        assert a.final_recall == b.final_recall, policy


@SETTINGS
@given(case=sequences())
def test_no_important_means_no_recall(case):
    A, T, P, B, _, _ = case
    for policy in valid_defaults(B, P, T):
        r = kvsim.simulate(A, policy, B, P)
        assert r.recall is None and r.final_recall is None


# ------------------------------------------------------------------ errors


def _valid(T=10):
    return make_attention(T, "softmax", 0)


def _non_causal(T=10):
    A = make_attention(T, "softmax", 0)
    A[2, 5] = 0.1
    A[2] /= A[2].sum()  # rows still sum to 1, but a key above the diagonal
    return A


def _bad_rows(T=10):
    A = make_attention(T, "softmax", 0)
    A[4] *= 0.5
    return A


ERROR_CASES = [
    pytest.param(_valid(), "window", 0, 5, {}, id="budget-0-window"),
    pytest.param(_valid(), "h2o", 0, 5, {}, id="budget-0-h2o"),
    pytest.param(_valid(), "oracle", 0, 5, {}, id="budget-0-oracle"),
    pytest.param(_valid(), "random", -1, 5, {}, id="budget-negative-random"),
    pytest.param(_valid(), "streaming_llm", 4, 5, {}, id="streaming-budget-eq-default-sinks"),
    pytest.param(_valid(), "streaming_llm", 2, 5, {"sinks": 2}, id="streaming-budget-eq-sinks"),
    pytest.param(_valid(), "streaming_llm", 3, 10, {"sinks": 4}, id="streaming-budget-lt-sinks-no-decode"),
    pytest.param(_valid(), "snapkv", 32, 5, {}, id="snapkv-budget-eq-default-window"),
    pytest.param(_valid(), "snapkv", 4, 5, {"window": 4}, id="snapkv-budget-eq-window"),
    pytest.param(_valid(), "snapkv", 4, 10, {"window": 4}, id="snapkv-budget-eq-window-no-decode"),
    pytest.param(_valid(), "snapkv", 6, 5, {"window": 4, "protect_window": False}, id="snapkv-unprotected-with-decode"),
    pytest.param(_valid(), "snapkv", 6, 0, {"window": 4, "protect_window": False}, id="snapkv-unprotected-prompt-0"),
    pytest.param(_valid(), "no_such_policy", 4, 5, {}, id="unknown-policy"),
    pytest.param(_valid(), "window", 4, 5, {"bogus": 1}, id="unknown-param-window"),
    pytest.param(_valid(), "h2o", 4, 5, {"recent_ratioo": 0.5}, id="unknown-param-h2o-typo"),
    pytest.param(_non_causal(), "window", 4, 5, {}, id="non-causal-matrix"),
    pytest.param(_bad_rows(), "window", 4, 5, {}, id="row-not-summing-to-1"),
    pytest.param(_bad_rows(), "full", 4, 5, {}, id="row-not-summing-to-1-full"),
    pytest.param(np.ones((3, 4)) / 4, "window", 2, 1, {}, id="non-square-matrix"),
    pytest.param(-_valid(), "window", 4, 5, {}, id="negative-matrix"),
]


@pytest.mark.quick
@pytest.mark.parametrize("attention, policy, budget, prompt_len, params", ERROR_CASES)
def test_invalid_arguments_raise(attention, policy, budget, prompt_len, params):
    assert issubclass(kvsim.KvsimError, ValueError)
    with pytest.raises(kvsim.KvsimError):
        kvsim.simulate(attention, policy, budget, prompt_len, **params)


# Errors the semantics imply but the brief did not list; kept separate so a failure is easy to read.
EXTRA_ERROR_CASES = [
    pytest.param("h2o", 4, 5, {"recent_ratio": 1.0}, id="h2o-recent-ratio-1"),
    pytest.param("h2o", 4, 5, {"recent_ratio": -0.1}, id="h2o-recent-ratio-negative"),
    pytest.param("h2o", 4, 5, {"accumulate": "sometimes"}, id="h2o-bad-accumulate"),
    pytest.param("snapkv", 8, 5, {"window": 4, "pooling": "median"}, id="snapkv-bad-pooling"),
    pytest.param("snapkv", 8, 5, {"window": 4, "kernel": 4}, id="snapkv-even-kernel"),
    pytest.param("window", 4, 11, {}, id="prompt-longer-than-T"),
    pytest.param("window", 4, -1, {}, id="prompt-negative"),
]


@pytest.mark.quick
@pytest.mark.parametrize("policy, budget, prompt_len, params", EXTRA_ERROR_CASES)
def test_other_invalid_arguments_raise(policy, budget, prompt_len, params):
    with pytest.raises(kvsim.KvsimError):
        kvsim.simulate(_valid(), policy, budget, prompt_len, **params)


@SETTINGS
@given(sequences(), st.sampled_from([0.0, 0.25, 0.5, 0.75]))
def test_offline_h2o_decode_keeps_the_prefill_selection(seq, ratio):
    """With static scores, decoding from any P ends with the selection a prefill at T makes.

    Needs r >= 1: the incoming token always enters, so decoding with r = 0 acts as r = 1.
    """
    A, T, P, B, _, _ = seq
    assume(int(ratio * B) >= 1 or P == T)
    at_end = kvsim.simulate(A, "h2o_offline", B, T, recent_ratio=ratio).kept
    decoded = kvsim.simulate(A, "h2o_offline", B, P, recent_ratio=ratio).kept
    assert np.array_equal(decoded, at_end)
