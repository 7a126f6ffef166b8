"""``filtering`` (kvpress PR 258's FilteringPress and UniformFilteringPress) against the plain
reference (``filtering_caches``), per KV head and by the layer's majority, on layers of
several KV heads; append-only invariants; refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import filtering_caches
from test_protocols import attention
from test_uniform_heads import PARAMS, cached, layer_runs

from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params
from kvsim.protocols.filtering import majority_target, per_head_target
from kvsim.protocols.settings import label, problem


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("mode", ["per_head", "majority"])
def test_filtering_matches_the_reference(name, mode):
    rng = np.random.default_rng([len(name), len(mode)])
    for _ in range(12):
        kv_heads, T = int(rng.integers(1, 4)), int(rng.integers(4, 36))
        P = int(rng.integers(0, T + 1))
        B = int(rng.integers(4, max(5, P + 3)))
        full = {**PARAMS[name], "filtering": mode,
                "filter_ratio": float(rng.choice([0.0, 0.25, 0.5, 0.7, 0.9]))}
        As = np.stack([attention(rng, T) for _ in range(kv_heads)])
        prefill, steps = filtering_caches(list(As), name, P, T, B, full)
        got = layer_runs(As, name, full, B, P)[0]
        ctx = f"{name} {full} T={T} P={P} B={B} kv_heads={kv_heads}"
        assert cached(got) == [sorted(s) for s in steps], ctx
        mass = [sum(As[0, P + i, k] for k in sorted(s)) for i, s in enumerate(steps)]
        np.testing.assert_allclose(got.mass[0], mass, rtol=0, atol=1e-9, err_msg=ctx)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kv_heads=st.integers(1, 3), T=st.integers(1, 40),
       B=st.integers(4, 12), name=st.sampled_from(sorted(PARAMS)),
       mode=st.sampled_from(["per_head", "majority"]), ratio=st.sampled_from([0.1, 0.5, 0.8]),
       data=st.data())
def test_append_only(seed, kv_heads, T, B, name, mode, ratio, data):
    """Only the newest key ever leaves, right after its own query; majority keeps the same
    decode keys in every KV head."""
    rng = np.random.default_rng(seed)
    P = data.draw(st.integers(0, T))
    As = np.stack([attention(rng, T) for _ in range(kv_heads)])
    traces = layer_runs(As, name, {**PARAMS[name], "filtering": mode, "filter_ratio": ratio},
                        B, P)
    for trace in traces:
        caches = cached(trace)
        for t, (before, after) in enumerate(zip(caches, caches[1:]), start=P):
            assert set(after) - set(before) == {t + 1}
            assert set(before) - set(after) <= {t}
            assert t in before
    if mode == "majority":
        decoded = [[[k for k in c if k >= P] for c in cached(t)] for t in traces]
        assert all(d == decoded[0] for d in decoded)


def test_targets_are_the_codes():
    """n_kept floored from the tokens seen (FilteringPress) or the cache (Uniform...), at
    least 1, in double precision as Python computes it (kvpress at 48cc0e2)."""
    assert per_head_target(0, 0.5) == 1  # int(0.5) = 0, at least 1
    assert per_head_target(2, 0.5) == 1 and per_head_target(3, 0.5) == 2
    assert per_head_target(9, 0.9) == 1  # 10 * (1 - 0.9) = 0.9999999999999998: 0, at least 1
    assert per_head_target(19, 0.9) == 1  # 20 * (1 - 0.9) = 1.9999999999999996
    assert majority_target(10, 0.75) == 2 and majority_target(3, 0.9) == 1


def test_refusals_and_label():
    h2o, window = POLICIES["h2o"], POLICIES["window"]
    params = {**resolve_params(h2o, {}), "filtering": "majority", "filter_ratio": 0.25}
    assert problem(h2o, params, 64, 100, 200) is None
    assert label(params) == "filtering=majority/ratio=0.25"
    found = problem(window, {**resolve_params(window, {}), "filtering": "per_head"}, 64, 100, 200)
    assert found is not None and found[0] == "filtering"
    found = problem(h2o, {**params, "interval": 4}, 64, 100, 200)
    assert found is not None and "expected one protocol" in found[1]
