"""Protocols (interval, target_ratio, question_len with compress) against the plain
reference, neutral settings against the per-step rule, invariants and one-line errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from broken import cli
from policy_checks import field_source, qk_field, qkv_field
from reference import (l2_norm, paged_caches, protocol_caches, rkv_protocol_caches,
                       threshold_caches)

import kvsim
from kvsim.errors import KvsimError
from kvsim.numerics.field import dense_field
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params, run_policy
from kvsim.protocols.settings import label, problem

REFERENCE = {"h2o": {"recent_ratio": 0.25}, "h2o_offline": {"recent_ratio": 0.25}, "tova": {},
             "window": {}, "streaming_llm": {"sinks": 2}, "knorm": {"recent_ratio": 0.25}}


def with_keys(A):
    """A dense field over ``A`` with random key vectors (for knorm), and their reference
    scores ``-||k||``."""
    T = A.shape[0]
    keys = np.random.default_rng(T).standard_normal((1, 3, T)).astype(np.float32)
    score = [-l2_norm(keys[0, :, k].astype(np.float64)) for k in range(T)]
    return dense_field(A[None])._replace(keys=keys), score


def attention(rng, T):
    """Random causal attention with a few exact ties (quantised logits)."""
    L = np.round(rng.standard_normal((T, T)) * 2.0, 1)
    A = np.tril(np.exp(L))
    return A / A.sum(axis=1, keepdims=True)


def run(A, name, params, B, P, field=None):
    """kvsim's trace with the cache recorded at every decode step."""
    T = A.shape[0]
    policy = POLICIES[name]
    group = make_group(dense_field(A[None]) if field is None else field, 0, P,
                       np.zeros((1, T), bool), {},
                       snap_budget=B, snap_steps=np.arange(T - P))
    return run_policy(policy, group, B, resolve_params(policy, params))


def protocols(rng, P, T):
    """A random protocol: interval, target_ratio with interval, before-question."""
    kind = rng.integers(4)
    N = int(rng.choice([1, 2, 3, 5, T]))  # T: larger than the decode length
    if kind == 0:
        return {"interval": N}
    if kind == 1:
        return {"interval": N, "target_ratio": float(rng.choice([0.3, 0.5, 0.9]))}
    Q = int(rng.choice([0, 1, 3, P]))  # P: the whole prompt is the question
    out = {"question_len": Q, "compress": "before_question"}
    return out if kind == 2 else {**out, "interval": N}


def check_reference(A, name, params, B, P, reference=None):
    """kvsim's cache at every step against the plain reference's (``reference(p, policy,
    P, T, B, params)``, by default that of the protocol ``params`` asks), its masses to
    1e-9 and its final cache; returns kvsim's trace."""
    T = A.shape[0]
    full = {**REFERENCE[name], **params}
    field, static = with_keys(A) if name == "knorm" else (None, None)
    got = run(A, name, full, B, P, field)
    full = {**full, "_static": static}
    if reference is not None:
        prefill, steps = reference(A, name, P, T, B, full)
    elif "page" in params:
        prefill, steps = paged_caches(A, name, P, T, B, full)
    elif "threshold" in params:
        prefill, steps = threshold_caches(A, name, P, T, full)
    else:
        prefill, steps = protocol_caches(A, name, P, T, B, full)
    ctx = f"{name} {full} T={T} P={P} B={B}"
    caches = [sorted(int(k) for k in row if k >= 0) for row in got.snapshots]
    assert caches == [sorted(s) for s in steps], ctx
    assert got.cache_size.tolist() == [len(s) for s in steps], ctx
    mass = [sum(A[P + i, k] for k in sorted(s)) for i, s in enumerate(steps)]
    np.testing.assert_allclose(got.mass[0], mass, rtol=0, atol=1e-9, err_msg=ctx)
    final = sorted(steps[-1]) if steps else sorted(prefill)
    assert got.kept.tolist() == final, ctx
    return got


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_protocols_match_the_reference(name):
    rng = np.random.default_rng(sum(map(ord, name)))
    for _ in range(25):
        T = int(rng.integers(8, 40))
        P = int(rng.integers(1, T))
        B = int(rng.integers(max(4, REFERENCE[name].get("sinks", 0) + 2), max(5, P + 3)))
        params = protocols(rng, P, T)
        if problem(POLICIES[name], {**REFERENCE[name], **params}, B, P, T):
            continue
        check_reference(attention(rng, T), name, params, B, P)


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_pages_match_the_reference(name):
    rng = np.random.default_rng(7 + sum(map(ord, name)))
    for _ in range(25):
        T = int(rng.integers(8, 48))
        P = int(rng.integers(1, T))
        S = int(rng.choice([2, 3, 4]))
        B = int(rng.integers(2 * S, 6 * S + 1))  # S divides P or not, B or not
        params = {"page": S, "page_reduce": str(rng.choice(["mean", "max"]))}
        if problem(POLICIES[name], {**REFERENCE[name], **params}, B, P, T):
            continue
        check_reference(attention(rng, T), name, params, B, P)


@pytest.mark.parametrize("name", ["h2o", "h2o_offline", "tova", "knorm"])
def test_thresholds_match_the_reference(name):
    rng = np.random.default_rng(11 + sum(map(ord, name)))
    for _ in range(25):
        T = int(rng.integers(8, 40))
        P = int(rng.integers(0, T))
        tau = float(rng.choice([-1.5, 0.0, 0.05, 0.2, 0.5, 1.5, 1e9]))  # 1e9: above every score
        params = {"threshold": tau, "threshold_window": int(rng.integers(1, 10))}
        check_reference(attention(rng, T), name, params, 8, P)


@pytest.mark.parametrize("name", sorted(REFERENCE))
@pytest.mark.parametrize("params", [
    {"interval": 100},  # N larger than the decode length: never compresses after prefill
    {"interval": 4, "target_ratio": 0.5},
    {"question_len": 12, "compress": "before_question"},  # Q = P
    {"question_len": 12, "compress": "before_question", "interval": 3},
    {"page": 3},  # S divides P = 12
    {"page": 5, "page_reduce": "max"},  # S does not divide P
])
def test_protocol_edge_cases(name, params):
    B = 10 if params.get("page") == 5 else 6  # at least two pages
    assert problem(POLICIES[name], {**REFERENCE[name], **params}, B, 12, 30) is None
    check_reference(attention(np.random.default_rng(3), 30), name, params, B, 12)


NEUTRAL = [{"interval": 1}, {"target_ratio": 1.0}, {"page": 1}, {"page": 1, "page_reduce": "max"}, {"question_len": 0, "compress": "before_question"},
           {"question_len": 5, "compress": "after_question"}]


@pytest.mark.parametrize("name", sorted(n for n, p in POLICIES.items() if p.budgeted))
def test_neutral_settings_give_the_per_step_rule(name):
    """interval = 1, Q = 0 (or after the question): exactly today's results."""
    field = qkv_field(2, 1, seed=4)
    T, P, B = field.T, 14, 6
    policy = POLICIES[name]
    small = {k: 2 if k != "block" else 1 for k in ("window", "page_size", "block")
             if k in policy.params}  # fit B = 6
    params = resolve_params(policy, small)
    group = make_group(field, 0, P, np.zeros((2, T), bool), {})
    base = run_policy(policy, group, B, params)
    for neutral in NEUTRAL:
        got = run_policy(policy, group, B, {**params, **neutral})
        assert np.array_equal(got.mass, base.mass) and np.array_equal(got.kept, base.kept), neutral
        assert np.array_equal(got.cache_size, base.cache_size), neutral


STEPPED = sorted(n for n, p in POLICIES.items()
                 if p.budgeted and p.steps is not None and p.run_budgets is None)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STEPPED), seed=st.integers(0, 3), N=st.integers(1, 30),
       Q=st.integers(0, 6), P=st.integers(8, 20), B=st.integers(5, 12),
       ratio=st.sampled_from([1.0, 0.4, 0.7]))
def test_protocol_invariants(name, seed, N, Q, P, B, ratio):
    """Peak <= B + Q + N - 1, the cache shrinks only at compressions, every decode query
    sees its own key, and target_ratio's compressions reach their target."""
    field = qkv_field(2, 1, seed=seed)
    T = field.T
    policy = POLICIES[name]
    params = resolve_params(policy, {"window": 2} if "window" in policy.params else {})
    params = {**params, "interval": N, "question_len": min(Q, P), "compress": "before_question",
              "target_ratio": ratio}
    if B < policy.min_budget(params) or policy.check(T, P, params) \
            or problem(policy, params, B, P, T):
        return
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, snap_budget=B,
                       snap_steps=np.arange(T - P))
    trace = run_policy(policy, group, B, params)  # what the checks accept runs
    sizes = trace.cache_size
    if ratio == 1.0:
        assert sizes.max(initial=0) <= B + min(Q, P) + N - 1
    for i, row in enumerate(trace.snapshots):
        assert P + i in row  # the incoming key is cached
        if i and sizes[i] < sizes[i - 1] + 1:  # shrank: only at a compression step
            t = P + i
            assert (t - P + 1) % N == 0 if ratio != 1.0 else sizes[i - 1] == B + min(Q, P) + N - 1
            if ratio != 1.0:
                assert sizes[i] <= max(1, int(ratio * (t + 1)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STEPPED), seed=st.integers(0, 3), S=st.integers(2, 5),
       P=st.integers(0, 20), B=st.integers(4, 16), reduce=st.sampled_from(["mean", "max"]))
def test_page_invariants(name, seed, S, P, B, reduce):
    """At most floor(B / S) pages held, the receiving one included; pages leave whole, only
    when a key opens a page."""
    field = qkv_field(2, 1, seed=seed)
    T = field.T
    policy = POLICIES[name]
    params = {**resolve_params(policy, {}), "page": S, "page_reduce": reduce}
    if B < policy.min_budget(params) or policy.check(T, P, params) \
            or problem(policy, params, B, P, T):
        return
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, snap_budget=B,
                       snap_steps=np.arange(T - P))
    trace = run_policy(policy, group, B, params)
    before = None
    for i, row in enumerate(trace.snapshots):
        t, cache = P + i, set(int(k) for k in row if k >= 0)
        pages = {k // S for k in cache}
        assert len(pages) <= B // S and t in cache
        if before is not None:
            gone = before - cache
            assert not gone or t % S == 0  # only a key opening a page evicts
            assert all(j * S + d not in cache for j in {k // S for k in gone} for d in range(S))
        before = cache


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(STEPPED), seed=st.integers(0, 3), w=st.integers(1, 8),
       P=st.integers(0, 20), tau=st.sampled_from([0.0, 0.01, 0.1, 0.3, 2.0]))
def test_threshold_invariants(name, seed, w, P, tau):
    """Nothing kept is ever evicted: a key leaves only as it leaves the window; the w
    newest are always held."""
    field = qkv_field(2, 1, seed=seed)
    T = field.T
    policy = POLICIES[name]
    params = {**resolve_params(policy, {}), "threshold": tau, "threshold_window": w}
    if problem(policy, params, 8, P, T) or policy.check(T, P, params):
        return
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, snap_budget=8,
                       snap_steps=np.arange(T - P))
    trace = run_policy(policy, group, 8, params)
    before = None
    for i, row in enumerate(trace.snapshots):
        t, cache = P + i, set(int(k) for k in row if k >= 0)
        assert set(range(max(t - w + 1, 0), t + 1)) <= cache
        if before is not None:
            assert before - cache <= {t - w}
        before = cache


@pytest.mark.parametrize("kind, params, words", [
    ("quest", {"page": 4}, "quest takes no protocol (page)"),
    ("window", {"threshold": 0.1}, "window takes no threshold"),
    ("snapkv", {"threshold": 0.1, "window": 4}, "snapkv takes no threshold"),
    ("h2o", {"page": 16}, "at least 2 pages"),
    ("h2o", {"page": 4, "interval": 4}, "got interval and page"),
    ("h2o", {"threshold": 0.1, "question_len": 4, "compress": "before_question"},
     "got threshold and question_len"),
    ("h2o", {"page": 4, "recent_ratio": 0.9}, "protected pages"),
    ("oracle", {"interval": 4}, "oracle takes no protocol (interval)"),
    ("quest", {"question_len": 4, "compress": "before_question"}, "quest takes no protocol"),
    ("snapkv", {"interval": 4, "refresh": 8, "window": 4}, "refresh is itself"),
    ("h2o", {"target_ratio": 0.5, "question_len": 4, "compress": "before_question"},
     "got target_ratio and question_len"),
    ("h2o", {"question_len": 40}, "expected at most prompt_len"),
    ("h2o", {"interval": 0}, "expected an integer >= 1"),
    ("h2o", {"target_ratio": 0.01, "recent_ratio": 0.5}, "protected keys"),
])
def test_meaningless_combinations_are_one_line_errors(kind, params, words):
    A = attention(np.random.default_rng(0), 40)
    with pytest.raises(KvsimError) as exc:
        kvsim.simulate(A, kind, 16, 30, **params)
    assert words in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("seed", range(16))
def test_rkv_ranks_the_cache_once_per_compression(seed):
    """R-KV under interval (and target_ratio): each compression ranks the cache plus the
    incoming key once, as the authors' code compresses its buffer (not key by key)."""
    rng = np.random.default_rng([37, seed])
    T, G = int(rng.integers(24, 44)), int(rng.integers(1, 4))
    field = qk_field(rng, T, G, kind=("gauss", "ints", "pool")[seed % 3])
    policy = POLICIES["rkv"]
    params = resolve_params(policy, {"window": int(rng.integers(1, 5)),
                                     "kernel": int(rng.choice([1, 3, 5])),
                                     "mix_lambda": float(rng.choice([0.0, 0.07, 0.5, 1.0]))})
    P = int(rng.integers(params["window"] + 2, T - 6))
    B = int(rng.integers(params["window"] + 1, P + 2))
    params["interval"] = int(rng.choice([2, 3, 5, 8]))
    if seed % 4 == 3:
        params["target_ratio"] = 0.95
    if problem(policy, params, B, P, T):
        params.pop("target_ratio", None)
    group = make_group(field, 0, P, np.zeros((G, T), bool), {}, snap_budget=B,
                       snap_steps=np.arange(T - P))
    trace = run_policy(policy, group, B, params)
    prefill, steps = rkv_protocol_caches(field_source(field), P, T, B, params)
    assert [sorted(int(k) for k in row if k >= 0) for row in trace.snapshots] == steps
    assert trace.kept.tolist() == steps[-1]


DOCS = Path(__file__).parent.parent / "docs" / "protocols.md"
TRY = {"interval": {"interval": 4}, "target_ratio": {"interval": 4, "target_ratio": 0.9},
       "page": {"page": 4}, "threshold": {"threshold": 0.01},
       "question_len": {"question_len": 8, "compress": "before_question"}}


def _ranks_by(policy) -> str:
    """How a batched compression ranks the policy's cache (kvsim.protocols.interval)."""
    if policy.rescore is not None:
        return "re-scored once (`rescore`)"
    if policy.steps.rank is not None:
        return "its scores, once (`Steps.rank`)"
    return "age, once" if policy.layout.position_rule else "`admit`, key by key"


def test_the_docs_say_which_policy_takes_which_protocol():
    """docs/protocols.md's table is what the registry's checks accept (default parameters,
    a budget well above the minimum), row for row."""
    want = ["| policy | " + " | ".join(f"`{s}`" for s in TRY)
            + " | a batched compression ranks by |", "| --- " * (len(TRY) + 2) + "|"]
    for name, policy in POLICIES.items():
        params = resolve_params(policy, {})
        B = policy.min_budget(params) + 64
        takes = [problem(policy, {**params, **s}, B, 4 * B, 8 * B) is None for s in TRY.values()]
        want.append(f"| `{name}` | " + " | ".join("yes" if t else "no" for t in takes)
                    + f" | {_ranks_by(policy) if any(takes) else '(takes none)'} |")
    lines = DOCS.read_text().splitlines()
    start = lines.index(want[0])
    got = lines[start:start + len(want) + 1]
    assert got == want + [""]


def test_target_ratio_with_question_len_is_refused_by_validate(tmp_path):
    """Only question_len combines with interval: a scenario file with target_ratio and a
    question is one line at validate time (exit 2), naming the file and the key."""
    path = tmp_path / "s.toml"
    path.write_text('[attention]\nsource = "field"\nT = 48\nheads = 1\n'
                    '[policies.h2o]\ntarget_ratio = 0.5\ninterval = 4\nquestion_len = 4\n'
                    'compress = "before_question"\n'
                    '[[experiment]]\nprompt_len = 24\nbudgets = [8]\n')
    status, out, err = cli(["validate", path])
    assert status == 2 and out == ""
    assert err.strip() == (f"{path}: policies.h2o.question_len: expected one protocol (only "
                           "question_len combines with interval, and heads with page), got "
                           "target_ratio and "
                           "question_len (experiment 'experiment0', budget 8)")


def test_results_name_the_protocol_and_the_memory_held():
    A = attention(np.random.default_rng(1), 60)
    res = kvsim.simulate(A, policies={"per_step": {"kind": "h2o"},
                                      "batched": {"kind": "h2o", "interval": 8}},
                         budgets=[10], prompt_len=40)
    rows = {r["policy"]: r for r in res.rows}
    assert rows["per_step"]["protocol"] == "per_step" and rows["per_step"]["peak_size"] == 10
    assert rows["batched"]["protocol"] == "interval=8" and rows["batched"]["h2o.interval"] == 8
    assert rows["batched"]["peak_size"] == 17 and rows["batched"]["effective_ratio"] == 17 / 60
    assert 10 <= rows["batched"]["mean_size"] <= 17
    assert label({"question_len": 4, "compress": "before_question", "interval": 2}) \
        == "interval=2+before_question(Q=4)"


def _row(kind, policy, protocol, budget, peak, mean_size, mass, head=0):
    return {"kind": kind, "policy": policy, "protocol": protocol, "budget": budget,
            "peak_size": peak, "mean_size": mean_size, "mass_mean": mass, "head": head,
            "seed": 0}


def test_report_opens_with_the_cost_of_each_protocol_at_equal_peak():
    from kvsim.report import protocol_summary

    rows = [_row("h2o", "h2o", "per_step", 64, 64, 64.0, 0.9),
            _row("h2o", "h2o_i16", "interval=16", 49, 64, 56.5, 0.85),
            _row("tova", "tova", "per_step", 64, 64, 64.0, 0.8),
            _row("tova", "tova_i16", "interval=16", 49, 64, 56.5, 0.7),
            _row("tova", "tova_i8", "interval=8", 49, 56, 52.5, 0.6)]  # no per-step at 56
    lines = protocol_summary.lines(rows)
    assert lines[0].startswith("**At equal peak memory")
    assert "costs attention mass in 2 of 2 (policy, protocol) pairs" in lines[0]
    assert lines[2] == "| policy | `interval=16`, peak 64 |"
    assert "| `h2o` | -0.050 (1 of 1 below 0, -0.050 to -0.050) |" in lines
    assert "| `tova` | -0.100 (1 of 1 below 0, -0.100 to -0.100) |" in lines
    table = "\n".join(line for line in lines if line.startswith("|"))
    assert "interval=8" not in table and "-0.075" not in "\n".join(lines)
    assert lines[-2].startswith("Not in the table") and "`interval=8` (peak 56)" in lines[-2]
    assert protocol_summary.lines(rows[:1]) == []


def test_threshold_study_compares_with_top_k_at_equal_mean_size():
    from kvsim.report import protocol_study

    rows = [_row("h2o", "h2o", "per_step", b, b, float(b), m)
            for b, m in ((64, 0.6), (128, 0.8))]
    rows += [_row("h2o", f"h2o_t{i}", "threshold=0.1/window=32", b, 0, size, mass)
             for i, (size, mass) in enumerate(((96.0, 0.75), (200.0, 0.9))) for b in (64, 128)]
    points = protocol_study.points(rows)[0]
    assert points["h2o (threshold)"][0].tolist() == [96.0, 200.0]  # one point per label
    assert protocol_study.gaps(rows) == {"h2o": pytest.approx(0.75 - 0.7)}  # 200: outside
    (inside, total), = protocol_study._differences(rows).values()  # the section counts them
    assert inside == [pytest.approx(0.05)] and total == 2


def test_protocols_compose_with_a_capped_head():
    """Budget allocation: the head's cap plays B, the recent part stays the mean budget's."""
    from kvsim.protocols.run import run_capped

    field = qkv_field(2, 1, seed=2)
    T, P = field.T, 12
    group = make_group(field, 0, P, np.zeros((2, T), bool), {})
    policy = POLICIES["h2o"]
    params = {**resolve_params(policy, {}), "interval": 3}
    trace = run_capped(policy, group, 7, 6, params)
    assert trace.cache_size.max() <= 7 + 3 - 1 and trace.cache_size.max() > 7
    paged = run_capped(policy, group, 8, 6, {**resolve_params(policy, {}), "page": 2})
    assert len({int(k) // 2 for k in paged.kept}) <= 4


@pytest.mark.parametrize("name", sorted(set(STEPPED) - {"keydiff", "random"}))
def test_ranked_once_equals_evicting_the_lowest_key_by_key(name):
    """Where the scores of cached keys do not depend on the other cached keys, a batched
    compression by ``Steps.rank`` keeps what the policy's own ``admit`` keeps, evicting
    key by key (the fallback for a policy without ``rank``)."""
    import dataclasses

    from kvsim.protocols.dispatch import run_protocol

    field = qkv_field(2, 1, seed=3)
    T, P, B = field.T, 10, 7
    policy = POLICIES[name]
    params = {**resolve_params(policy, {"window": 2} if "window" in policy.params else {}),
              "interval": 4}
    if B < policy.min_budget(params) or policy.check(T, P, params):
        return
    group = make_group(field, 0, P, np.zeros((2, T), bool), {}, snap_budget=B,
                       snap_steps=np.arange(T - P))
    fallback = dataclasses.replace(policy, steps=dataclasses.replace(policy.steps, rank=None))
    a, b = run_protocol(policy, group, B, params), run_protocol(fallback, group, B, params)
    assert np.array_equal(np.sort(a.snapshots, axis=1), np.sort(b.snapshots, axis=1))
    np.testing.assert_allclose(a.mass, b.mass, rtol=0, atol=1e-12)
