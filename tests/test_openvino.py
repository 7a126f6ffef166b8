"""``openvino`` (OpenVINO GenAI's CacheEvictionAlgorithm): the cases of openvino.genai's own
unit tests (tests/cpp/cache_eviction.cpp at da1db86: accumulated scores, NORM_SUM counters,
the blocks evicted), every KV head of a several-head layer against the plain reference
step by step, and the block invariants on random fields."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_checks import qk_field
from reference import policy_openvino, qk_source
from test_author_code import layer_sources, model_field

from kvsim.numerics.kernels import GQA_MEAN
from kvsim.policies import POLICIES
from kvsim.policies.openvino import Scores, arena, evicted_slots
from kvsim.protocols.run import make_group, resolve_params, run_policy

OPENVINO = POLICIES["openvino"]


def scores_of(registrations, pool, mode="norm_sum", window=0, start=0):
    """Scores after the code's registrations: the first as the prefill's, the others (each
    one key longer) as decode steps."""
    scores = Scores({"pool": pool, "mode": mode})
    first = np.array(registrations[0], float)
    scores.prefill(np.concatenate((np.zeros(start), first)), start, start + first.size, window)
    for row in registrations[1:]:
        scores.register(np.array(row, float))
    return scores


@pytest.mark.parametrize("registrations, pool, acc, seen", [
    # more_scores_second_time (max-pool width 0 in the code: no pooling)
    ([[1.5, -0.8, 4.1, 7.7], [-7.4, 2.6, 8.9, -0.1, 3.5]], 1,
     [-5.9, 1.8, 13.0, 7.6, 3.5], [5, 4, 3, 2, 1]),
    # with_max_pool
    ([[1.5, -0.8, 4.1, 7.7, 3.6, -7.4]], 3, [4.1, 7.7, 7.7, 7.7, 3.6, -7.4], [6, 5, 4, 3, 2, 1]),
    # with_max_pool_two_score
    ([[1.5, -0.8, 4.1, 7.7, 3.6, -7.4], [-7.4, 2.6, 8.9, 3.5, 7.4, -3.8, 0.1]], 3,
     [13.0, 16.6, 16.6, 15.1, 11.0, -7.3, 0.1], [7, 6, 5, 4, 3, 2, 1]),
])
def test_scores_and_counters_are_the_codes(registrations, pool, acc, seen):
    scores = scores_of(registrations, pool)
    np.testing.assert_allclose(scores.acc, acc, atol=1e-12)
    assert scores.seen.tolist() == seen


@pytest.mark.parametrize("P, window, steps, seen", [
    (6, 4, 0, [4, 4, 4, 3, 2, 1]),           # snapkv_window_exactly_filled
    (7, 4, 0, [4, 4, 4, 4, 3, 2, 1]),        # a window inside a longer prompt
    (6, 4, 1, [5, 5, 5, 4, 3, 2, 1]),        # ..._followed_by_generation_step
    (6, 4, 2, [6, 6, 6, 5, 4, 3, 2, 1]),     # ..._followed_by_two_generation_steps
])
def test_snapkv_counters_are_the_codes(P, window, steps, seen):
    scores = scores_of([np.ones(P)] + [np.ones(P + s + 1) for s in range(steps)], 1,
                       window=window)
    assert scores.seen.tolist() == seen


SHORT = {"block": 4, "start_blocks": 8, "recent_blocks": 8, "pool": 1, "snapkv_window": 0}


@pytest.mark.parametrize("max_cache, over, zeroed, evicted", [
    (192, 1, {17}, {17}), (192, 1, {9}, {9}),                          # one_block
    (192, 10, {28, 10, 11}, {28, 10, 11}), (192, 10, {18, 8, 31}, {18, 8, 31}),  # three_blocks
    (192, 6, {15, 36, 13, 10}, {10, 13}), (192, 6, {9, 39, 31, 11}, {9, 11}),   # ties: lower first
    (192, 22, set(), {8, 9, 10, 11, 12, 13}), (192, 22, {30, 22}, {8, 9, 10, 11, 22, 30}),
    (192, 22, {0, 2, 7, 24, 31, 49}, {8, 9, 10, 11, 24, 31}),       # zeros outside the middle
    (192, 22, {5, 19, 27, 39, 50, 52}, {8, 9, 10, 19, 27, 39}),
    (72, 17, {0, 9, 10, 11, 13}, {8, 9, 10, 11, 13}),                # more overflow than middle
    (72, 17, {12, 11, 8, 9, 17}, {8, 9, 10, 11, 12}),
])
def test_the_codes_evicted_blocks(max_cache, over, zeroed, evicted):
    """LOW_SCORE_BLOCK_EVICTION_TEST_CASES (block 4, start 32, recent 32, NORM_SUM, no
    SnapKV window, no pooling): scores 1, 0 in the zeroed blocks, registered once."""
    params = resolve_params(OPENVINO, {**SHORT, "mode": "norm_sum"})
    budget = max_cache + 3  # the arena's peak: max_cache + block - 1
    assert arena(budget, 4) == max_cache
    n = budget + over
    row = np.ones(n)
    for b in zeroed:
        row[4 * b:4 * b + 4] = 0.0
    scores = Scores(params)
    scores.prefill(row, 32, n, 0)
    assert set((evicted_slots(scores, n, params, budget) // 4).tolist()) == evicted


@pytest.mark.parametrize("seed", range(8))
def test_layer_reference(seed):
    """Every KV head of a several-head layer against the plain reference, step by step: one
    cache for the whole layer; the same stepped inside a model (BlockLayer)."""
    rng = np.random.default_rng(700 + seed)
    G, kv_heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    T = int(rng.integers(12, 40))
    field = model_field(rng, T, G, kv_heads=kv_heads)
    params = {"block": int(rng.integers(1, 4)), "start_blocks": int(rng.integers(1, 3)),
              "recent_blocks": int(rng.integers(1, 3)), "snapkv_window": int(rng.integers(0, 5)),
              "pool": int(rng.integers(1, 5)), "mode": ("sum", "norm_sum")[seed % 2]}
    check_layer_runs(OPENVINO, policy_openvino, rng, field, T, kv_heads, params, seed)
    check_stepped_layer(OPENVINO, policy_openvino, rng, field, T, kv_heads, params, seed)


def check_layer_runs(policy, reference, rng, field, T: int, kv_heads: int, params: dict,
                     seed: int) -> None:
    """``policy`` against its plain layer ``reference`` on every KV head of ``field``, at
    prompts 0, random and T and budgets at the floor and random: the same cache at every
    step, alike in every KV head."""
    sources = layer_sources(field)
    resolved = resolve_params(policy, params)
    low = policy.min_budget(resolved)
    for P in sorted({0, int(rng.integers(0, T + 1)), T}):
        for budget in sorted({low, int(rng.integers(low, T + 2))}):
            caches = []
            for kv in range(kv_heads):
                group = make_group(field, kv, P, np.zeros((field.heads, T), bool), {}, GQA_MEAN,
                                   snap_budget=budget, snap_steps=np.arange(T - P))
                got = run_policy(policy, group, budget, resolved)
                prefill, steps = reference(sources[kv], P, T, budget, "mean", layer=sources,
                                           **resolved)
                ours = [sorted(int(x) for x in row if x >= 0) for row in got.snapshots]
                assert ours == [sorted(c) for c in steps], (seed, P, budget, kv)
                assert got.kept.tolist() == sorted(steps[-1] if steps else prefill)
                caches.append(ours)
            assert all(c == caches[0] for c in caches)


def stepped_layer(name: str, params: dict, field, P: int, T: int, budget: int,
                  widen_at: int | None = None, extra: int = 0):
    """(prefill selection, [C_t]) of a BlockLayer fed each KV head's full attention rows
    over the one cache, one step at a time, as a decoder feeds it (each view admits, then
    each KV head observes its own query heads' rows); ``extra`` more keys from the start."""
    from kvsim.protocols.stepping import BlockLayer

    sources = layer_sources(field)
    stack = np.stack([s.probs[:, :P, :P] for s in sources])
    layer = BlockLayer(name, budget, params, prompt_attention=stack, capacity_T=T,
                       keys=[np.ascontiguousarray(field.keys[kv].T) for kv in
                             range(len(sources))])
    views = [layer.head(j) for j in range(len(sources))]
    prefill = sorted(views[0].cache.tolist())
    for view in views if extra else ():
        view.widen(extra)
    steps = []
    for t in range(P, T):
        for view in views:
            assert view.admit(t) == -1
        cache = views[0].cache
        assert all(v.cache.tolist() == cache.tolist() for v in views)
        assert cache.shape[0] <= budget + extra
        steps.append(sorted(cache.tolist()))
        for source, view in zip(sources, views):
            view.observe(source.probs[:, t, cache])
    return prefill, steps


def check_stepped_layer(policy, reference, rng, field, T: int, kv_heads: int, params: dict,
                        seed: int) -> None:
    """BlockLayer against the plain layer ``reference`` at prompts 0, random and T and
    budgets at the floor and random: the same cache at every step, in every KV head."""
    sources = layer_sources(field)
    resolved = resolve_params(policy, params)
    low = policy.min_budget(resolved)
    for P in sorted({0, int(rng.integers(0, T + 1)), T}):
        for budget in sorted({low, int(rng.integers(low, T + 2))}):
            prefill, steps = reference(sources[0], P, T, budget, "mean", layer=sources,
                                       **resolved)
            got_prefill, got_steps = stepped_layer(policy.name, params, field, P, T, budget)
            assert got_prefill == sorted(prefill), (seed, P, budget)
            assert got_steps == [sorted(c) for c in steps], (seed, P, budget)


def test_a_widened_layer_takes_the_widened_arena():
    """A task's question widens the arena by its keys: they join without eviction, and
    then the cache holds at most ``A + Q + S - 1 <= B + Q`` keys; the layer refuses what a
    decoder must not do."""
    from kvsim.errors import KvsimError
    from kvsim.protocols.stepping import BlockLayer

    rng = np.random.default_rng(5)
    T, P, B, Q = 64, 30, 15, 9
    field = model_field(rng, T, 1, kv_heads=2)
    params = {"block": 2, "start_blocks": 1, "recent_blocks": 1}
    prefill, steps = stepped_layer("openvino", params, field, P, T, B, extra=Q)
    assert [len(c) for c in steps[:Q]] == list(range(len(prefill) + 1, len(prefill) + Q + 1))
    assert max(len(c) for c in steps) == arena(B, 2) + Q + 1 == B + Q
    _, narrow = stepped_layer("openvino", params, field, P, T, B)
    assert max(len(c) for c in narrow) == arena(B, 2) + 1 == B
    layer = BlockLayer("openvino", B, params, capacity_T=T,
                       prompt_attention=np.stack([s.probs[:, :P, :P]
                                                  for s in layer_sources(field)]))
    layer.head(0).admit(P)
    with pytest.raises(KvsimError, match="observed by every KV head"):
        layer.head(1).observe(layer_sources(field)[1].probs[:, P, layer.head(1).cache])
        layer.head(0).admit(P + 1)
    with pytest.raises(KvsimError, match="once per token"):
        layer.head(1).observe(layer_sources(field)[1].probs[:, P, layer.head(1).cache])
    with pytest.raises(KvsimError, match="Stepper or UniformLayer"):
        BlockLayer("h2o", 8, {}, prompt_attention=np.ones((1, 1, 4, 4)) / 4, capacity_T=8)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), T=st.integers(1, 48), block=st.integers(1, 4),
       start=st.integers(1, 3), recent=st.integers(1, 3), extra=st.integers(0, 12),
       mode=st.sampled_from(["sum", "norm_sum"]), window=st.integers(0, 9),
       pool=st.integers(1, 8), data=st.data())
def test_block_invariants(seed, T, block, start, recent, extra, mode, window, pool, data):
    """Peak <= B; the start area and the recent area are never evicted; keys leave in whole
    aligned blocks and never come back; the reference agrees."""
    rng = np.random.default_rng(seed)
    P = data.draw(st.integers(0, T))
    params = resolve_params(OPENVINO, {"block": block, "start_blocks": start,
                                       "recent_blocks": recent, "mode": mode,
                                       "snapkv_window": window, "pool": pool})
    B = OPENVINO.min_budget(params) + extra
    field = qk_field(rng, T, 2)
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, GQA_MEAN, snap_budget=B,
                       snap_steps=np.arange(T - P))
    trace = run_policy(OPENVINO, group, B, params)
    assert trace.cache_size.max(initial=0) <= B
    caches = [set(int(x) for x in row if x >= 0) for row in trace.snapshots]
    S, first = block, block * start
    gone = set()
    for t, cache in zip(range(P, T), caches):
        seen = set(range(t + 1))
        assert set(range(min(first, t + 1))) <= cache
        assert set(range(max(0, t + 1 - S * recent), t + 1)) <= cache
        out = seen - cache
        assert gone <= out
        gone = out
        assert all(all(k in out for k in range(b * S, b * S + S)) for b in {k // S for k in out})
    src = qk_source(field.queries, field.keys[0].T, field.values[0], field.qk_scale)
    prefill, steps = policy_openvino(src, P, T, B, "mean", **params)
    assert [sorted(c) for c in caches] == [sorted(c) for c in steps]
