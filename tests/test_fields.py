"""Composed attention fields: exact equivalence with a dense twin, what each component
does, determinism across builds and thread counts, and O(T) memory.

A component field is checked three ways:
- every policy gives *bit-identical* results on it and on its dense twin (the same
  probabilities materialised as an (H, T, T) matrix), so the on-the-fly logit path
  and the dense path of the kernels agree exactly;
- each component is compared with its closed form (sinks, recency, heavy-hitter
  strengths, boosts, q.k logits) or its distribution (counter-hash noise);
- builds and CLI runs are reproducible, whatever the number of threads.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from policy_checks import SMALL_PARAMS
from scipy import stats

import kvsim
from kvsim.attention.components import BOOST, build
from kvsim.numerics.field import FieldData, dense_field, logits_at, logits_row, probs_at, probs_row
from kvsim.numerics.fullpass import full_pass
from kvsim.numerics.kernels import GQA_MODES
from kvsim.policies import POLICIES
from kvsim.policies.base import run_decode
from kvsim.protocols.run import field_provides, make_group, resolve_params, run_policy, run_problems

# ---------------------------------------------------------------------------------------
# Helpers


def field_toml(body: str, T: int, seeds=(0,)) -> str:
    """A complete scenario with a composed field; ``body`` continues the [attention] table."""
    return (f"seeds = {list(seeds)}\n\n[attention]\nsource = \"field\"\nT = {T}\n{body}\n\n"
            "[policies.full]\n\n[[experiment]]\nbudgets = [1]\nfigures = []\n")


def load_field(body: str, T: int) -> kvsim.Scenario:
    """Load (and so validate and resolve) a field scenario written from ``body``."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "field.toml"
        path.write_text(field_toml(body, T))
        return kvsim.load_scenario(path)


def boost(**params) -> dict:
    """A fully resolved boost (BOOST defaults filled in), for ``build_field(boosts=...)``."""
    return {k: float(params.get(k, p.default)) if p.type is float else params.get(k, p.default)
            for k, p in BOOST.items()}


def build_field(body: str, T: int, seed: int = 0, boosts=()) -> tuple[FieldData, np.ndarray | None,
                                                                     kvsim.Scenario]:
    """(field, ground truth or None, scenario) of a field scenario.

    ``boosts`` are (head, resolved boost) pairs appended to the scenario's own: boosts
    by ``key_positions`` cannot be written in a scenario yet (see
    ``test_boost_key_positions_in_a_scenario``), so the tests add them here.
    """
    scenario = load_field(body, T)
    a = scenario.attention
    per_head = [dict(c, boost=list(c["boost"])) for c in a["per_head"]]
    for h, b in boosts:
        per_head[h]["boost"].append(b)
    data, truth = build(per_head, a["T"], a["kv_heads"], seed)
    return data, truth, scenario


def row_stats(field: FieldData) -> tuple[np.ndarray, np.ndarray]:
    """(H, T) row maxima and sums from the full pass of every head."""
    row_max = np.zeros((field.heads, field.T))
    row_sum = np.ones((field.heads, field.T))
    for h in range(field.heads):
        fp = full_pass(field, h, field.T)
        row_max[h], row_sum[h] = fp.row_max, fp.row_sum
    return row_max, row_sum


def rows(field: FieldData, what: str = "probs", whole_row: bool = True) -> np.ndarray:
    """The (H, T, T) causal matrix of probabilities (or logits) of a component field.

    Probabilities come from :func:`probs_row` with the full pass's row statistics, so
    they are the very numbers the kernels use; entries above the diagonal are 0. With
    ``whole_row = False`` each row is evaluated the way a cache is, by :func:`probs_at`
    (keys given in a scattered order, not as one whole row).
    """
    H, T = field.heads, field.T
    row_max, row_sum = row_stats(field) if what == "probs" else (None, None)
    out = np.zeros((H, T, T))
    buf = np.empty(T)
    for h in range(H):
        for q in range(T):
            keys = np.arange(T) if whole_row else np.r_[np.arange(q, -1, -1), q + 1:T]
            work, no_cache = np.empty(T), np.zeros((0, 0))
            if what == "probs" and whole_row:
                probs_row(field, row_max, row_sum, h, q, keys, q + 1, buf, work)
            elif what == "probs":
                probs_at(field, row_max, row_sum, h, q, keys, q + 1, buf, work, no_cache)
            elif whole_row:
                logits_row(field, h, q, keys, q + 1, buf, work)
            else:
                logits_at(field, h, q, keys, q + 1, buf, work, no_cache)
            out[h, q, keys[:q + 1]] = buf[:q + 1]
    return out


def dense_twins(field: FieldData) -> tuple[FieldData, FieldData]:
    """The same attention as a dense field, two ways (values kept for the output error).

    The first is ``field._replace(probs=P)``; the second is built from scratch with
    :func:`dense_field`, so the dense path has no component arrays to fall back on.
    """
    P = rows(field)
    # Rows summing to 1 means the full pass and probs_at evaluate the same logits. (If
    # not, after an edit to field.py, suspect a stale Numba cache: cache=True does not
    # notice changes in functions defined in another file; clear kvsim/__pycache__.)
    assert np.abs(P.sum(axis=2) - 1.0).max() < 1e-12, "full pass and probs_at disagree"
    assert not np.triu(P, 1).any()
    # a cache's view of a row (any keys, any order) sees exactly the same numbers
    assert np.array_equal(P, rows(field, whole_row=False))
    bare = dense_field(P, field.keys.shape[0])
    return (field._replace(probs=P),
            bare._replace(values=field.values, value_heads=field.value_heads))


def same_trace(a, b) -> bool:
    return (np.array_equal(a.kept, b.kept) and a.kept.dtype == b.kept.dtype
            and np.array_equal(a.cache_size, b.cache_size)
            and all(np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True)
                    for name in ("mass", "recall", "error")))


ARRAYS = [name for name in FieldData._fields if name not in ("group", "rope_scale")]

# ---------------------------------------------------------------------------------------
# 1. A component field and its dense twin give exactly the same runs

SINKS = "[attention.sinks]\ncount = 3\nstrength = 4.0\n"
POWER = "[attention.recency]\nkind = \"power\"\nalpha = 1.5\n"
EXP = "[attention.recency]\nkind = \"exp\"\ntau = 6.0\n"
HEAVY = "[attention.heavy_hitters]\ncount = 5\nstrength = 5.0\nexponent = 0.7\n"
BOOSTS = "[[attention.boost]]\nkeys = [5, 8]\nqueries = [20, 32]\nstrength = 5.0\n"
NEEDLES = ((0, boost(key_positions=[2, 17], queries=[10, 40], strength=3.0, important=False)),)
GAUSSIAN = "[attention.noise]\nkind = \"gaussian\"\nscale = 1.5\n"
GUMBEL = "[attention.noise]\nkind = \"gumbel\"\nscale = 1.0\n"
QK = "[attention.qk]\ndim = 8\nclusters = 3\nstrength = 3.0\nvalues = true\n"

SINGLE_HEAD = {
    "sinks": SINKS, "recency_power": POWER, "recency_exp": EXP, "heavy_hitters": HEAVY,
    "boost": BOOSTS, "noise_gaussian": GAUSSIAN, "noise_gumbel": GUMBEL, "qk": QK,
    "all": SINKS + POWER + HEAVY + GAUSSIAN + QK + BOOSTS,
    "all_exp_gumbel": SINKS + EXP + HEAVY + GUMBEL + QK.replace("true", "false") + BOOSTS,
}

GQA_BODY = """\
heads = 4
kv_heads = 2
gqa = "{gqa}"

[attention.sinks]
count = 2
strength = 3.0
[attention.recency]
alpha = 0.8
[attention.heavy_hitters]
count = 4
strength = 4.0
[attention.qk]
dim = 8
clusters = 3
strength = 2.0

[[attention.head]]
[attention.head.noise]
kind = "gaussian"
[[attention.head]]
[attention.head.recency]
kind = "exp"
tau = 5.0
[[attention.head.boost]]
keys = [6, 9]
queries = [18, 30]
[[attention.head]]
[attention.head.noise]
kind = "gumbel"
scale = 0.7
[attention.head.qk]
strength = 4.0
[[attention.head]]
[attention.head.sinks]
strength = 6.0
"""

def runnable(field: FieldData, kv: int) -> dict:
    """The registered policies whose needs (key, value, query vectors) ``field`` meets."""
    return {name: p for name, p in POLICIES.items() if p.needs <= field_provides(field, kv)}


def check_equivalence(field: FieldData, truth, gqa: int, prompt_lens, budgets) -> int:
    """Every policy on ``field`` and on its dense twin; returns the number of runs compared."""
    twins = dense_twins(field)
    assert not field.is_dense and all(t.is_dense for t in twins)
    H, T = field.heads, field.T
    important = truth if truth is not None else np.zeros((H, T), bool)
    if truth is None:
        important[:, [1, 7, 13, T - 2]] = True  # so that recall is exercised too
    passes: list[dict] = [{}, {}, {}]
    compared = evicted = 0
    for kv in range(field.keys.shape[0]):
        for P in prompt_lens:
            gc, *gds = (make_group(f, kv, P, important, p, gqa, seed=3)
                        for f, p in zip((field, *twins), passes))
            for h, a, *bs in zip(gc.heads, gc.passes(), *(g.passes() for g in gds)):
                for b in bs:
                    for name in ("prompt_colsum", "decode_colsum", "full_output"):
                        assert np.array_equal(getattr(a, name), getattr(b, name)), (h, P, name)
            for name, policy in runnable(field, kv).items():
                params = resolve_params(policy, SMALL_PARAMS.get(name, {}))
                twins_with_needs = [gd for gd in gds
                                    if policy.needs <= field_provides(gd.field, kv)]
                assert twins_with_needs  # the first twin keeps every vector of the field
                for B in budgets:
                    assert not run_problems(policy, params, [B], T, P)
                    tc = run_policy(policy, gc, B, params)
                    for gd in twins_with_needs:
                        td = run_policy(policy, gd, B, params)
                        assert same_trace(tc, td), f"{name} kv={kv} P={P} B={B}"
                    assert tc.mass.shape == (field.group, T - P)
                    if field.has_values(kv):
                        assert not np.isnan(tc.error).any()
                    compared += 1
                    evicted += bool((tc.mass < 1.0 - 1e-9).any())
    assert evicted > 0  # the comparison is not vacuous: some caches do lose mass
    return compared


@pytest.mark.parametrize("body", list(SINGLE_HEAD.values()), ids=list(SINGLE_HEAD))
def test_component_field_matches_dense_twin_exactly(body):
    field, truth, _ = build_field(body, T=40, seed=1, boosts=NEEDLES if BOOSTS in body else ())
    n = check_equivalence(field, truth, GQA_MODES["mean"], prompt_lens=(0, 17, 40),
                          budgets=(5, 11))
    assert n == len(runnable(field, 0)) * 3 * 2


@pytest.mark.parametrize("gqa", ["mean", "max", "sum"])
def test_gqa_field_matches_dense_twin_exactly(gqa):
    field, truth, scenario = build_field(GQA_BODY.format(gqa=gqa), T=32, seed=2)
    assert (field.heads, field.keys.shape[0], field.group) == (4, 2, 2)
    assert scenario.gqa == gqa
    n = check_equivalence(field, truth, scenario.gqa_mode, prompt_lens=(0, 13, 32),
                          budgets=(5, 12))
    assert n == sum(len(runnable(field, kv)) for kv in range(2)) * 3 * 2


@pytest.mark.quick
def test_tiny_field_matches_dense_twin_exactly():
    """A small all-components case (also run without JIT)."""
    body = (SINKS + POWER + GAUSSIAN + "[attention.qk]\ndim = 4\nclusters = 2\n"
            "[attention.heavy_hitters]\npositions = [4, 9]\n"
            "[[attention.boost]]\nkeys = [2, 3]\nqueries = [8, 12]\n")
    field, truth, _ = build_field(body, T=12, seed=0)
    with_vectors, twin = dense_twins(field)  # the twin has no vectors: for attention only
    important = truth
    for P in (0, 7, 12):
        gc = make_group(field, 0, P, important, {})
        for name, policy in runnable(field, 0).items():
            gd = make_group(with_vectors if policy.needs else twin, 0, P, important, {})
            params = resolve_params(policy, SMALL_PARAMS.get(name, {}))
            assert same_trace(run_policy(policy, gc, 6, params),
                              run_policy(policy, gd, 6, params)), (name, P)


def test_a_group_showing_progress_reads_its_own_vectors():
    """``progress`` is the group's own setting, never taken for its vectors (a run with a
    progress bar on a field with keys used to fail)."""
    field, _, _ = build_field("[attention.qk]\ndim = 4\nclusters = 2\nvalues = true\n",
                              T=12, seed=0)
    important = np.zeros((field.group, 12), bool)  # one KV head of one query head
    quiet, shown = (make_group(field, 0, 6, important, {}, progress=p) for p in (False, True))
    assert shown.progress and shown.vectors == ()
    assert np.array_equal(shown.keys, quiet.keys) and np.array_equal(shown.values, quiet.values)
    params = resolve_params(POLICIES["knorm"], {})
    assert same_trace(run_policy(POLICIES["knorm"], shown, 6, params),
                      run_policy(POLICIES["knorm"], quiet, 6, params))


# ---------------------------------------------------------------------------------------
# 2. Each component does what it says


@pytest.mark.quick
def test_sinks_share_is_closed_form():
    count, s, T = 3, 2.5, 16
    field, truth, _ = build_field(f"[attention.sinks]\ncount = {count}\nstrength = {s}\n", T)
    assert truth is None
    assert np.array_equal(field.key_bias[0], np.r_[np.full(count, s), np.zeros(T - count)])
    P = rows(field)[0]
    for q in range(T):
        share = P[q, :count].sum()
        if q < count:
            assert abs(share - 1.0) < 1e-12
        else:
            w = count * np.exp(s)
            assert abs(share - w / (w + q + 1 - count)) < 1e-12, q
            # the non-sink keys share the rest uniformly
            assert np.abs(P[q, count:q + 1] - 1.0 / (w + q + 1 - count)).max() < 1e-12


def test_recency_power_and_exp_are_closed_form():
    T = 16
    d = np.arange(T, dtype=np.float64)
    for body, weight in [
        ("kind = \"power\"\nalpha = 1.3", (1.0 + d) ** -1.3),
        ("kind = \"exp\"\ntau = 3.5", np.exp(-d / 3.5)),
        ("kind = \"power\"\nalpha = 0.0", np.ones(T)),
    ]:
        field, _, _ = build_field("[attention.recency]\n" + body, T)
        P = rows(field)[0]
        for q in range(T):
            # p(q, k) proportional to w(q - k), normalised over k <= q
            expected = weight[q - np.arange(q + 1)] / weight[:q + 1].sum()
            assert np.abs(P[q, :q + 1] - expected).max() < 1e-12, (body, q)


def test_heavy_hitters_positions_and_power_law_strengths():
    T = 48
    strength, exponent, count, lo, hi = 5.0, 0.8, 6, 4, 40
    field, truth, _ = build_field(
        f"[attention.heavy_hitters]\ncount = {count}\nstrength = {strength}\n"
        f"exponent = {exponent}\nlo = {lo}\nhi = {hi}\n", T, seed=5)
    planted = np.flatnonzero(field.key_bias[0])
    assert planted.size == count and lo <= planted.min() and planted.max() < hi
    assert np.array_equal(np.flatnonzero(truth[0]), planted)  # the planted keys are the truth
    expected = strength * np.arange(1, count + 1, dtype=np.float64) ** -exponent
    assert np.allclose(np.sort(field.key_bias[0, planted])[::-1], expected, rtol=0, atol=1e-12)

    # explicit positions (deduplicated), a fraction of a range, and not-important ones
    field, truth, _ = build_field(
        "[attention.heavy_hitters]\npositions = [9, 3, 20, 9]\nstrength = 2.0\nexponent = 1.0\n", T)
    assert np.array_equal(np.flatnonzero(truth[0]), [3, 9, 20])
    assert np.allclose(sorted(field.key_bias[0, [3, 9, 20]]), [2 / 3, 1.0, 2.0], rtol=0, atol=1e-12)
    field, truth, _ = build_field("[attention.heavy_hitters]\nfraction = 0.25\nhi = 40\n", T)
    assert truth[0].sum() == 10 and np.flatnonzero(truth[0]).max() < 40
    field, truth, _ = build_field("[attention.heavy_hitters]\ncount = 3\nimportant = false\n", T)
    assert truth is None and np.count_nonzero(field.key_bias[0]) == 3


def test_strong_heavy_hitters_dominate_the_column_sums():
    T, count, hi = 64, 6, 12
    body = (f"[attention.heavy_hitters]\ncount = {count}\nhi = {hi}\nstrength = 10.0\n"
            "exponent = 0.1\n")
    rhos = []
    for seed in range(8):
        field, truth, _ = build_field(body + GAUSSIAN.replace("1.5", "0.3"), T, seed)
        fp = full_pass(field, 0, T // 2)
        colsum = fp.prompt_colsum + fp.decode_colsum
        hh = truth[0]
        assert colsum[hh].min() > colsum[~hh].max(), seed
        rhos.append(stats.spearmanr(colsum[hh], field.key_bias[0, hh]).statistic)
    assert min(rhos) > 0.5 and np.mean(rhos) > 0.8, rhos

    # Without noise, over the rows that see every heavy hitter (q >= hi), column sums
    # are exactly proportional to exp(strength): each row is exp(strength) / Z_q.
    field, truth, _ = build_field(body, T, seed=0)
    fp = full_pass(field, 0, hi)
    hh = np.flatnonzero(truth[0])
    ratio = fp.decode_colsum[hh] / np.exp(field.key_bias[0, hh])
    assert np.abs(ratio / ratio[0] - 1.0).max() < 1e-12
    assert stats.spearmanr(fp.decode_colsum[hh], field.key_bias[0, hh]).statistic == 1.0


def test_noise_distributions():
    T = 448  # T (T + 1) / 2 = 100,576 entries per head
    body = ("heads = 3\n[attention.noise]\nkind = \"gaussian\"\n"
            "[[attention.head]]\n"
            "[[attention.head]]\n[attention.head.noise]\nkind = \"gumbel\"\n"
            "[[attention.head]]\n[attention.head.noise]\nscale = 2.0\n")
    field, _, _ = build_field(body, T, seed=4)
    assert np.array_equal(field.noise_kind, [1, 2, 1])
    assert len(set(field.noise_key.tolist())) == 3
    L = rows(field, "logits")  # noise is the only term: logits are the noise itself
    # a pure function of (seed, head, q, k): a shorter sequence, evaluated key by key
    # in a cache's order rather than row by row, has the very same noise
    short, _, _ = build_field(body, T=64, seed=4)
    assert np.array_equal(L[:, :64, :64], rows(short, "logits", whole_row=False))
    low = np.tril(np.ones((T, T), bool))
    gauss, gumbel, gauss2 = (L[h][low] for h in range(3))
    assert gauss.size == 100_576
    assert abs(gauss.mean()) < 0.01 and abs(gauss.std() - 1.0) < 0.01
    assert stats.kstest(gauss, "norm").statistic < 0.01
    assert abs(gumbel.mean() - np.euler_gamma) < 0.01
    assert abs(gumbel.std() - np.pi / np.sqrt(6)) < 0.02
    assert stats.kstest(gumbel, "gumbel_r").statistic < 0.01
    assert abs(gauss2.std() - 2.0) < 0.02
    # independent across heads and across neighbouring entries
    assert abs(np.corrcoef(gauss, gauss2)[0, 1]) < 0.02
    below = np.tril(np.ones((T, T), bool), -1)[:, :-1]  # (q, k) with k + 1 <= q
    assert abs(np.corrcoef(L[0, :, :-1][below], L[0, :, 1:][below])[0, 1]) < 0.02
    assert abs(np.corrcoef(L[0, :-1][low[:-1]], L[0, 1:][low[:-1]])[0, 1]) < 0.02
    # another seed, another draw
    other, _, _ = build_field(body, T=16, seed=5)
    assert not np.array_equal(other.noise_key, field.noise_key)


def test_boost_adds_its_strength_exactly_where_it_says():
    T = 24
    field, truth, _ = build_field(
        "heads = 2\n[[attention.head]]\n[[attention.head]]\n[[attention.head.boost]]\n"
        "keys = [3, 6]\nqueries = [10, 15]\nstrength = 2.5\n", T,
        boosts=[(1, boost(key_positions=[1, 20], queries=[12, 24], strength=1.0))])
    L = rows(field, "logits")
    expected = np.zeros((T, T))
    expected[10:15, 3:6] += 2.5
    expected[12:24, [1, 20]] += 1.0
    assert np.array_equal(L[1], np.tril(expected))
    assert not L[0].any()  # boosts belong to their head only
    assert np.array_equal(np.flatnonzero(truth[1]), [1, 3, 4, 5, 20]) and not truth[0].any()


def test_boost_key_positions_in_a_scenario():
    body = "[[attention.boost]]\nkey_positions = [2, 17]\nqueries = [10, 32]\n"
    _, truth, _ = build_field(body, T=32)
    assert np.array_equal(np.flatnonzero(truth[0]), [2, 17])


def needle_scenario(query_lo: int) -> tuple[FieldData, np.ndarray]:
    body = ("[attention.sinks]\ncount = 4\nstrength = 3.0\n[attention.recency]\nalpha = 1.0\n"
            "[attention.noise]\nscale = 0.5\n"
            f"[[attention.boost]]\nkeys = [20, 22]\nqueries = [{query_lo}, 64]\nstrength = 8.0\n")
    field, truth, _ = build_field(body, T=64, seed=0)
    return field, truth


def test_needle_snapkv_finds_it_streaming_llm_does_not():
    P, B = 56, 16
    field, truth = needle_scenario(query_lo=48)  # the question: queries 48..63
    assert np.array_equal(np.flatnonzero(truth[0]), [20, 21])
    group = make_group(field, 0, P, truth, {})

    def run(name, **params):
        policy = POLICIES[name]
        trace = run_policy(policy, group, B, resolve_params(policy, params))
        return trace, truth[0][trace.kept].sum() / truth[0].sum()

    trace, recall = run("snapkv", window=8)  # window 48..55 sees the needle
    assert recall == 1.0 and trace.recall[0, -1] == 1.0
    assert (trace.recall[0, :] == 1.0).all()  # pinned from prefill on
    trace, recall = run("streaming_llm", sinks=4)
    assert recall == 0.0 and trace.recall[0, -1] == 0.0
    assert np.array_equal(trace.kept, np.r_[0:4, 52:64])

    # the same needle asked only after the observation window: SnapKV cannot know
    field, truth = needle_scenario(query_lo=58)
    group = make_group(field, 0, P, truth, {})
    assert run("snapkv", window=8)[1] == 0.0


def test_qk_logits_are_scaled_dot_products():
    T, d, strength = 24, 16, 3.0
    field, truth, _ = build_field(
        f"heads = 4\nkv_heads = 2\n[attention.qk]\ndim = {d}\nclusters = 3\n"
        f"strength = {strength}\n[[attention.head]]\n[[attention.head]]\n"
        "[attention.head.qk]\nstrength = -1.5\n[[attention.head]]\n[[attention.head]]\n", T)
    assert truth is None
    assert field.queries.shape == (4, T, d) and field.keys.shape == (2, d, T)  # keys by dimension
    assert field.values.shape == (2, T, d) and field.value_heads.all()
    L = rows(field, "logits")
    Q = field.queries.astype(np.float64)
    K = field.keys.astype(np.float64)
    for h, s in enumerate([strength, -1.5, strength, strength]):
        expected = np.tril(s * Q[h] @ K[h // 2] / np.sqrt(d))
        assert np.abs(L[h] - expected).max() < 1e-9, h
    # keys and values are per KV head (shapes above); every query head has its own queries
    assert not np.array_equal(field.queries[0], field.queries[1])
    assert not np.array_equal(field.keys[0], field.keys[1])


def test_gqa_groups_share_drawn_keys():
    field, truth, _ = build_field(
        "heads = 4\nkv_heads = 2\n[attention.heavy_hitters]\ncount = 5\n", T=48, seed=1)
    assert np.array_equal(truth[0], truth[1]) and np.array_equal(truth[2], truth[3])
    assert not np.array_equal(truth[0], truth[2])
    assert np.array_equal(field.key_bias[0], field.key_bias[1])


# ---------------------------------------------------------------------------------------
# 3. Determinism

ALL_SMALL = (SINKS + POWER + GAUSSIAN + "[attention.heavy_hitters]\ncount = 3\n"
             "[attention.qk]\ndim = 4\nclusters = 2\n"
             "[[attention.boost]]\nkeys = [2, 4]\nqueries = [4, 8]\n")


@pytest.mark.quick
def test_same_scenario_builds_identical_fields():
    body = "heads = 2\nkv_heads = 1\n" + ALL_SMALL
    a, ta, sa = build_field(body, T=16, seed=3)
    b, tb, sb = build_field(body, T=16, seed=3)
    assert sa.attention == sb.attention
    for name in ARRAYS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name
    assert a.group == b.group and np.array_equal(ta, tb)
    # and through the scenario's own entry point
    c = sa.field(3)
    assert all(np.array_equal(getattr(a, n), getattr(c.data, n)) for n in ARRAYS)
    # another seed is another sequence
    d, _, _ = build_field(body, T=16, seed=4)
    assert not np.array_equal(a.noise_key, d.noise_key)
    assert not np.array_equal(a.queries, d.queries)


CLI_SCENARIO = """\
name = "threads"
seeds = [0, 1]

[attention]
source = "field"
T = 96
heads = 4
kv_heads = 2
gqa = "max"

[attention.sinks]
count = 2
[attention.recency]
alpha = 0.7
[attention.noise]
kind = "gaussian"
scale = 1.0
[attention.heavy_hitters]
count = 6
[attention.qk]
dim = 8
clusters = 4
strength = 1.5

[[attention.head]]
[[attention.head]]
[attention.head.noise]
kind = "gumbel"
[[attention.head]]
[[attention.head.boost]]
keys = [30, 34]
queries = [60, 96]
[[attention.head]]

[policies.h2o]
[policies.snapkv]
window = 8
[policies.tova]
[policies.random]
[policies.oracle]

[[experiment]]
name = "decode"
prompt_len = 48
budgets = [16, 0.5]
figures = []

[[experiment]]
name = "prefill"
budgets = [20]
figures = []
"""


def test_cli_results_do_not_depend_on_thread_count(tmp_path):
    scenario = tmp_path / "threads.toml"
    scenario.write_text(CLI_SCENARIO)
    outs = []
    for threads in ("1", "2"):
        out = tmp_path / f"out{threads}"
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"}
        env["NUMBA_NUM_THREADS"] = threads
        proc = subprocess.run([sys.executable, "-m", "kvsim", str(scenario), "--out", str(out),
                               "--quiet"], env=env, capture_output=True, text=True, cwd=tmp_path,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outs.append(out)
    a, b = outs
    csv_a = (a / "results.csv").read_bytes()
    assert csv_a == (b / "results.csv").read_bytes()
    assert csv_a.count(b"\n") == 1 + 2 * 5 * 4 * 3  # seeds x policies x heads x budgets
    with np.load(a / "steps.npz") as sa, np.load(b / "steps.npz") as sb:
        assert sorted(sa.files) == sorted(sb.files)
        assert "decode/error" in sa.files
        for key in sa.files:
            assert sa[key].dtype == sb[key].dtype
            assert np.array_equal(sa[key], sb[key], equal_nan=True), key
        assert not np.isnan(sa["decode/error"]).any()


# ---------------------------------------------------------------------------------------
# 4. O(T) memory


@pytest.mark.quick
def test_component_field_memory_is_linear_in_T():
    body = "heads = 2\nkv_heads = 1\n" + ALL_SMALL
    small, _, _ = build_field(body, T=8)
    large, _, _ = build_field(body, T=16)
    for f in (small, large):
        assert f.probs.size == 0 and not f.is_dense
        T, d = f.T, f.queries.shape[2]
        assert d == 4
        for name in ARRAYS:
            a = getattr(f, name)
            assert list(a.shape).count(T) <= 1, (name, a.shape)  # never T x T
            assert a.size <= max(f.heads, f.boost_strength.size) * T * d, (name, a.shape)
    for name in ARRAYS:
        assert getattr(large, name).size <= 2 * getattr(small, name).size, name


@pytest.mark.parametrize("prompt_len", [0, 13, 39, 40])
def test_full_policy_read_off_the_pass_equals_the_decode_loop(prompt_len):
    """``full`` takes its trace from the full pass; running the decode loop with room for
    every key (nothing is ever evicted) gives the same trace."""
    field, _, _ = build_field(HEAVY + GAUSSIAN + QK, T=40, seed=2)
    important = np.zeros((1, 40), bool)
    important[0, [3, 17, 30]] = True
    group = make_group(field, 0, prompt_len, important, {})
    full = POLICIES["full"].run(group, 0, {})
    loop = run_decode(group, group.T, np.arange(prompt_len))
    assert np.allclose(full.mass, loop.mass, rtol=0, atol=1e-12)
    assert np.array_equal(full.cache_size, loop.cache_size)
    assert np.array_equal(full.recall, loop.recall, equal_nan=True)
    assert np.allclose(full.error, loop.error, rtol=0, atol=1e-12)
    assert np.array_equal(full.kept, loop.kept)
