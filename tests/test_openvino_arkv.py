"""``openvino_arkv`` (OpenVINO GenAI's CacheEvictionAlgorithm, ADAPTIVE_RKV mode): the
score queue, hand-computed diversity and mass splits, every KV head of a several-head
layer against the plain reference step by step, and the block invariants."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from policy_checks import qk_field
from reference import (arkv_block_diversity, arkv_most_diverse, arkv_split,
                       policy_openvino_arkv, qk_source)
from test_author_code import model_field
from test_openvino import check_layer_runs, check_stepped_layer

from kvsim.numerics.kernels import GQA_MEAN
from kvsim.policies import POLICIES
from kvsim.policies.openvino_arkv import (MeanScores, block_diversity, diversity_split,
                                          evicted_slots, most_diverse)
from kvsim.protocols.run import make_group, resolve_params, run_policy

ARKV = POLICIES["openvino_arkv"]


def test_scores_are_the_pooled_mean_of_the_last_registrations():
    """The prefill's scores as they are; then the mean of the queue (shorter rows padded
    with zeros), pooled; the oldest leaves after window_size; an eviction empties it."""
    scores = MeanScores({"pool": 2, "window_size": 2})
    scores.prefill(np.array([9.0, 1.0, 3.0, 2.0]), 1, 4, 8)
    assert scores.acc.tolist() == [1.0, 3.0, 2.0]  # no pooling at the prefill
    scores.register(np.array([3.0, 1.0, 0.0, 4.0]))
    # mean of [1, 3, 2, 0] and [3, 1, 0, 4] = [2, 2, 1, 2], pooled over 2
    assert scores.acc.tolist() == [2.0, 2.0, 2.0, 2.0]
    scores.register(np.array([1.0, 1.0, 6.0, 0.0, 2.0]))
    # the prefill's row left: mean of [3, 1, 0, 4, 0] and [1, 1, 6, 0, 2]
    assert scores.acc.tolist() == [2.0, 3.0, 3.0, 2.0, 1.0]  # [2, 1, 3, 2, 1] pooled
    scores.remove(np.array([0, 1]))
    assert scores.acc.tolist() == [3.0, 2.0, 1.0] and not scores.queue
    scores.register(np.array([5.0, 0.0, 1.0, 7.0]))
    assert scores.acc.tolist() == [5.0, 1.0, 7.0, 7.0]  # this row alone, pooled


def test_the_first_decode_registration_without_prefill_scores_is_kept_as_is():
    """A prompt inside the start area: the first tracked row is the code's initial scores."""
    scores = MeanScores({"pool": 3, "window_size": 8})
    scores.prefill(np.ones(2), 4, 2, 8)
    scores.register(np.array([0.5, 2.0]))
    assert scores.acc.tolist() == [0.5, 2.0]
    scores.register(np.array([0.5, 0.0, 1.0]))
    assert scores.acc.tolist() == [1.0, 1.0, 0.5]  # mean [0.5, 1, 0.5], pooled over 3


def test_diversity_by_hand():
    """Four keys in blocks of 2, one KV head: a = (1, 0), b = (1, 0), c = (0, 1),
    d = (1, 1)/sqrt(2) (as normalised, eps aside). Similarities without the diagonal:
    a: [0, 1, 0, s], b: [1, 0, 0, s], c: [0, 0, 0, s], d: [s, s, s, 0], s = 1/sqrt(2).
    Row means: a, b (1 + s)/4 = 0.43 keeps 1 and s; c s/4 keeps s; d 3s/4 keeps the s's.
    Block 0 (a, b): -[1, 1, 0, 2s]; block 1 (c, d): -[s, s, s, s]."""
    keys = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    s = 1 / np.sqrt(2)
    want = -np.array([[1, 1, 0, 2 * s], [s, s, s, s]])
    got = block_diversity([keys], 2)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(arkv_block_diversity([keys.tolist()], 2), want, rtol=1e-6)
    # two KV heads: the mean over heads (the second head's keys all alike: 1 off the
    # diagonal, every row's mean 3/4)
    same = np.ones((4, 2))
    both = block_diversity([keys, same], 2)
    np.testing.assert_allclose(both, (want - np.array([[1, 1, 2, 2], [2, 2, 1, 1]])) / 2,
                               rtol=1e-6)
    # the candidates' view: both blocks candidates, each row over all 4 columns / 4
    assert most_diverse(got, np.array([0, 1]), 1, 2).tolist() == [1]  # -s > -(2 + 2s)/4
    assert arkv_most_diverse(got.tolist(), [0, 1], 1, 2) == {1}


def test_a_similarity_equal_to_its_row_mean_stays():
    """Keys whose norms are powers of 2 far above eps, so every cosine is exact: e, e, h,
    h' with e = (1, 0, 0, 0), h = (1, 1, 1, 1)/2, h' = (1, -1, 1, 1)/2. The rows of e are
    [0, 1, .5, .5], mean .5: the .5's stay (the code's ``>=``); the rows of h and h' are
    all .5 off the diagonal."""
    keys = np.array([[2.0**20, 0, 0, 0], [2.0**20, 0, 0, 0],
                     [2.0**19] * 4, [2.0**19, -2.0**19, 2.0**19, 2.0**19]])
    want = -np.array([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.5, 0.5]])
    np.testing.assert_array_equal(block_diversity([keys], 2), want)
    np.testing.assert_array_equal(arkv_block_diversity([keys.tolist()], 2), want)


@pytest.mark.parametrize("scores, capacity, mass, rest, kept", [
    ([1.0, 5.0, 3.0, 1.0], 3, 0.5, [0, 2, 3], 1),   # 5 >= 0.5 * 10
    ([1.0, 5.0, 3.0, 1.0], 3, 0.8, [0, 3], 2),      # 5 + 3 >= 8
    ([1.0, 5.0, 3.0, 1.0], 1, 0.9, [0, 2, 3], 1),   # the capacity stops it
    ([1.0, 5.0, 3.0, 1.0], 3, 0.0, [0, 1, 2, 3], 0),  # nothing to reach
    ([2.0, 2.0, 2.0], 2, 0.3, [1, 2], 1),           # ties: the lower block first
    ([0.0, 0.0, 0.0], 2, 0.9, [0, 1, 2], 0),        # a zero total: all to diversity
    ([1.0, 1.0, 1.0], 3, 1.0, [], 3),
])
def test_mass_split_by_hand(scores, capacity, mass, rest, kept):
    got_rest, got_kept = diversity_split(np.array(scores), capacity, mass)
    assert (got_rest.tolist(), got_kept) == (rest, kept)
    assert arkv_split(scores, capacity, mass) == (rest, kept)


def test_equal_diversities_keep_the_lower_block():
    keys = np.tile([[1.0, 0.0]], (6, 1))  # all alike: every block as diverse
    diversity = block_diversity([keys], 2)
    assert most_diverse(diversity, np.array([0, 1, 2]), 2, 2).tolist() == [0, 1]


def test_eviction_keeps_the_mass_then_the_most_diverse():
    """Middle of 4 blocks of 2 (start 2, recent 2), 2 blocks stay: block 2 holds the mass;
    of blocks 0, 1, 3 the keys of block 3 point elsewhere, so it is the most diverse."""
    params = resolve_params(ARKV, {"block": 2, "start_blocks": 1, "recent_blocks": 1,
                                   "attention_mass": 0.5, "pool": 1})
    budget = 9  # A = 2 * 5 - 2 = 8: a middle of 4 keys, 2 blocks
    scores = MeanScores(params)
    acc = np.array([1.0, 1.0, 1.0, 1.0, 9.0, 9.0, 1.0, 1.0, 1.0, 1.0])  # 4 blocks + recent
    scores.prefill(np.concatenate((np.zeros(2), acc)), 2, 12, 8)
    d = np.array([[1.0, 0.0]] * 8 + [[0.0, 1.0]] * 2 + [[1.0, 0.0]] * 2 + [[1.0, 1.0]] * 2).T
    slots = evicted_slots(scores, [d], np.arange(12), 13, params, budget)
    assert sorted(slots.tolist()) == [2, 3, 4, 5]  # blocks 0 and 1 of the middle go


@pytest.mark.parametrize("seed", range(10))
def test_layer_reference(seed):
    """Every KV head of a several-head layer against the plain reference, step by step (same
    kept sets): one cache for the whole layer, one diversity from all its KV heads; the
    same stepped inside a model (BlockLayer, its keys read from the stores)."""
    rng = np.random.default_rng(900 + seed)
    G, kv_heads = int(rng.integers(1, 3)), int(rng.integers(1, 4))
    T = int(rng.integers(12, 40))
    field = model_field(rng, T, G, kv_heads=kv_heads)
    params = {"block": int(rng.integers(1, 4)), "start_blocks": int(rng.integers(1, 3)),
              "recent_blocks": int(rng.integers(1, 3)),
              "snapkv_window": int(rng.integers(0, 5)), "pool": int(rng.integers(1, 5)),
              "window_size": int(rng.integers(1, 6)),
              "attention_mass": float(rng.choice([0.0, 0.3, 0.9, 1.0]))}
    check_layer_runs(ARKV, policy_openvino_arkv, rng, field, T, kv_heads, params, seed)
    check_stepped_layer(ARKV, policy_openvino_arkv, rng, field, T, kv_heads, params, seed)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), T=st.integers(1, 40), block=st.integers(1, 4),
       start=st.integers(1, 3), recent=st.integers(1, 3), extra=st.integers(0, 12),
       mass=st.sampled_from([0.0, 0.5, 0.9, 1.0]), window=st.integers(0, 9),
       pool=st.integers(1, 8), window_size=st.integers(1, 9), data=st.data())
def test_block_invariants(seed, T, block, start, recent, extra, mass, window, pool,
                          window_size, data):
    """Peak <= B; the start and recent areas stay; keys leave in whole aligned blocks and
    never come back; the reference agrees."""
    rng = np.random.default_rng(seed)
    P = data.draw(st.integers(0, T))
    params = resolve_params(ARKV, {"block": block, "start_blocks": start,
                                   "recent_blocks": recent, "attention_mass": mass,
                                   "snapkv_window": window, "pool": pool,
                                   "window_size": window_size})
    B = ARKV.min_budget(params) + extra
    field = qk_field(rng, T, 2)
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, GQA_MEAN, snap_budget=B,
                       snap_steps=np.arange(T - P))
    trace = run_policy(ARKV, group, B, params)
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
    prefill, steps = policy_openvino_arkv(src, P, T, B, "mean", **params)
    assert [sorted(c) for c in caches] == [sorted(c) for c in steps]
