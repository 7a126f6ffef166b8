"""Every registered policy matches the plain reference (tests/reference.py) on sources with
vectors (random q.k fields with values, real trace heads) and dense matrices, with GQA.

Driven by the registry: a new policy is tested here by being registered (its reference must
exist, or these tests fail). Exact means: the same cache at every decode step, the same
final kept set, per-step mass, output error and recall within 1e-9 for every query head. A
decision that hinged on a rounding-level near tie (see reference.NEAR_TIE_RTOL) may differ:
it is then reported as a NearTieWarning, the cache sizes still compared.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from matrices import make_attention
from reference import dense_source, qk_source, reference_run

import kvsim
from kvsim import ScenarioError, load_scenario
from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, dense_field, empty_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.policies import POLICIES
from kvsim.policies.run import make_group, resolve_params, run_policy

TRACE = Path(__file__).parent.parent / "scenarios" / "traces" / "smollm2_gpl3.npz"

# Parameter variants besides the defaults, small enough for short sequences.
VARIANTS = {
    "streaming_llm": [{"sinks": 2}],
    "h2o": [{"recent_ratio": 0.25, "normalize": True}],
    "h2o_offline": [{"recent_ratio": 0.0}],
    "snapkv": [{"window": 3, "kernel": 3}, {"window": 3, "kernel": 3, "refresh": 2},
               {"window": 2, "kernel": 5, "pooling": "avg", "refresh": 1},
               {"window": 4, "kernel": 1, "pooling": "none", "refresh": 3},
               {"window": 1, "kernel": 3, "pooling": "max", "refresh": 5}],
    "knorm": [{"recent_ratio": 0.3}],
    "keydiff": [{"recent_ratio": 0.5}],
    "scissorhands": [{"history": 4}, {"history": 1, "recent_ratio": 0.0}],
    "quest": [{"page_size": 4}, {"page_size": 1}, {"page_size": 3}],
}
# Policies whose reference is single-head (the original seven): run on one query head.
MULTI_HEAD = {"knorm", "keydiff", "scissorhands", "caote", "snapkv", "quest", "full", "window",
              "streaming_llm"}


def cases(attention_only=False):
    out = []
    for name, policy in POLICIES.items():
        if attention_only and policy.needs:
            continue
        for params in [{}] + VARIANTS.get(name, []):
            tag = name + "".join(f"-{k}={v}" for k, v in params.items())
            out.append(pytest.param(name, params, id=tag))
    return out


CASES = cases()
ATTENTION_ONLY = cases(attention_only=True)


class NearTieWarning(UserWarning):
    """Kernel and reference broke a rounding-level near tie differently."""


def qk_field(rng, T, G, d=4, dv=3, kind="gauss") -> FieldData:
    """One KV head shared by G query heads: random queries, keys and values, scales."""
    f = empty_field(G, T, 1)
    if kind == "gauss":
        q, k = rng.standard_normal((G, T, d)), rng.standard_normal((1, d, T))
    elif kind == "ints":  # small integers: exact products, many exact ties
        q, k = rng.integers(-2, 3, (G, T, d)), rng.integers(-2, 3, (1, d, T))
    else:  # keys from a pool of 3 vectors (duplicates tie exactly), some zero keys
        q = rng.standard_normal((G, T, d))
        pool = np.vstack([rng.standard_normal((2, d)), np.zeros((1, d))])
        k = pool[rng.integers(0, 3, T)].T[None]
    f["queries"] = np.asarray(q, np.float32)
    f["keys"] = np.ascontiguousarray(k, np.float32)
    f["values"] = rng.standard_normal((1, T, dv)).astype(np.float32)
    f["value_heads"] = np.ones(1, bool)
    f["qk_scale"] = rng.choice([-1.0, 1.0], G) * rng.uniform(0.3, 2.0, G)
    return FieldData(**f)


def field_source(field: FieldData):
    """The reference's source for KV head 0 of a q.k field."""
    values = field.values[0] if field.has_values(0) else None
    return qk_source(field.queries, field.keys[0].T, values, field.qk_scale)


def run_kvsim(field, name, params, budget, prompt_len, gqa, important):
    T = field.T
    mask = np.zeros((field.heads, T), bool)
    mask[:, important] = True
    group = make_group(field, 0, prompt_len, mask, {}, GQA_MODES[gqa], snap_budget=budget,
                       snap_steps=np.arange(T - prompt_len))
    policy = POLICIES[name]
    return run_policy(policy, group, budget, resolve_params(policy, params))


def check(field, src, name, params, budget, prompt_len, gqa="mean", important=(0,)):
    important = sorted(set(int(i) for i in important if i < field.T))
    got = run_kvsim(field, name, params, budget, prompt_len, gqa, important)
    ref = reference_run(src, name, budget, prompt_len, gqa, important=important, **params)
    ctx = f"{name} {params} T={field.T} P={prompt_len} B={budget} G={field.heads} gqa={gqa}"
    assert np.array_equal(got.cache_size, ref.cache_size), ctx
    try:
        caches = [sorted(int(k) for k in row if k >= 0) for row in got.snapshots]
        for step, (a, b) in enumerate(zip(caches, ref.caches)):
            assert a == b, f"{ctx}: cache at step {step}: {a} != ref {b}"
        assert np.array_equal(got.kept, ref.kept), f"{ctx}: kept {got.kept} != {ref.kept}"
        np.testing.assert_allclose(got.mass, ref.mass, rtol=0, atol=1e-9, err_msg=ctx)
        if ref.error is not None:
            np.testing.assert_allclose(got.error, ref.error, rtol=0, atol=1e-9, err_msg=ctx)
        for g in range(field.heads):
            np.testing.assert_allclose(got.recall[g], ref.recall, rtol=0, atol=1e-9,
                                       err_msg=ctx)
    except AssertionError as exc:
        if not ref.near_tie:
            raise
        warnings.warn(NearTieWarning(f"near tie, results differ: {exc}"), stacklevel=2)


def budgets(name, params, T, rng):
    m = POLICIES[name].min_budget(resolve_params(POLICIES[name], params))
    return sorted({m, m + 1, int(rng.integers(m, max(m, T) + 3)), max(m, T)})


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_random_qk_fields(name, params, seed):
    """Random q.k fields with values: 1-3 query heads per KV head, every gqa rule."""
    rng = np.random.default_rng([seed, len(name), len(params)])
    G = int(rng.integers(1, 4)) if name in MULTI_HEAD else 1
    T = int(rng.integers(2, 36))
    kind = ("gauss", "ints", "pool")[seed % 3]
    field = qk_field(rng, T, G, kind=kind)
    src = field_source(field)
    gqa = ("mean", "max", "sum")[seed % 3]
    for P in sorted({0, int(rng.integers(0, T + 1)), T}):
        for B in budgets(name, params, T, rng):
            check(field, src, name, params, B, P, gqa, important=rng.choice(T, 3))


@pytest.mark.parametrize("name, params", ATTENTION_ONLY)
@pytest.mark.parametrize("recipe", ["softmax", "heavy", "quantised", "onehot", "sparse_ties"])
def test_dense_matrices(name, params, recipe):
    """Policies that need only attention, on dense matrices (one or two query heads)."""
    G = 2 if name in MULTI_HEAD else 1
    T = 30
    probs = np.stack([make_attention(T, recipe, 7 + g) for g in range(G)])
    field = dense_field(probs, 1)
    src = dense_source(probs)
    rng = np.random.default_rng(len(recipe))
    for P in (0, 11, 24, T):
        for B in budgets(name, params, T, rng):
            check(field, src, name, params, B, P, ("mean", "max", "sum")[P % 3],
                  important=[0, 5, 17])


def trace_field(layer: int, kv: int, T: int) -> FieldData:
    with np.load(TRACE) as data:
        q, k, v = data["queries"], data["keys"], data["values"]
        scale = float(data["scaling"])
    G = q.shape[1] // k.shape[1]
    f = empty_field(G, T, 1)
    f["queries"] = np.ascontiguousarray(q[layer, kv * G:(kv + 1) * G, :T], np.float32)
    f["keys"] = np.ascontiguousarray(k[layer, kv:kv + 1, :T].transpose(0, 2, 1), np.float32)
    f["values"] = np.ascontiguousarray(v[layer, kv:kv + 1, :T], np.float32)
    f["value_heads"] = np.ones(1, bool)
    f["qk_scale"] = np.full(G, scale)
    return FieldData(**f)


@pytest.mark.parametrize("name, params", CASES)
def test_real_trace_heads(name, params):
    """Heads of the committed SmolLM2 trace (3 query heads per KV head), first 64 tokens."""
    rng = np.random.default_rng(3)
    for layer, kv in ((0, 1), (2, 0)):
        field = trace_field(layer, kv, 64)
        if name not in MULTI_HEAD:  # one query head of the group
            field = field._replace(queries=field.queries[:1], qk_scale=field.qk_scale[:1],
                                   key_bias=field.key_bias[:1], distance=field.distance[:1],
                                   noise_kind=field.noise_kind[:1],
                                   noise_scale=field.noise_scale[:1],
                                   noise_key=field.noise_key[:1], group=1)
        src = field_source(field)
        for P in (0, 40, 64):
            for B in budgets(name, params, 64, rng):
                check(field, src, name, params, B, P, "mean", important=[0, 3, 50])


@pytest.mark.parametrize("name, params", CASES)
def test_min_budget_and_tiny_sequences(name, params):
    rng = np.random.default_rng(5)
    m = POLICIES[name].min_budget(resolve_params(POLICIES[name], params))
    for T in (1, 2, 3, 5):
        field = qk_field(rng, T, 2 if name in MULTI_HEAD else 1)
        src = field_source(field)
        for P in range(T + 1):
            check(field, src, name, params, m, P, "max", important=[T - 1])


@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if p.needs])
def test_dense_matrix_is_a_one_line_error(name):
    A = make_attention(80, "softmax", 0)
    with pytest.raises(KvsimError) as info:
        kvsim.simulate(A, name, 64, 6)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{name}: needs ")
    assert "dense attention matrix" in message


SCENARIO = """\
[attention]
source = "seed_notebook"
T = 64
[policies.{name}]
[[experiment]]
name = "e"
prompt_len = 32
budgets = [32]
"""


@pytest.mark.parametrize("name", [n for n, p in POLICIES.items() if p.needs])
def test_scenario_source_without_vectors_is_a_one_line_error(tmp_path, name):
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO.format(name=name))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    word = {"keys": "key", "values": "value", "queries": "query"}
    needs = " and ".join(f"{word[n]} vectors" for n in sorted(POLICIES[name].needs))
    assert info.value.lines() == [f"{path}: experiment[0].policies[0]: policy {name!r}: {name} "
                                  f"needs {needs}, which the 'seed_notebook' attention source "
                                  f"does not have"]


def _steppable_cases():
    from test_stepping import T as STEP_T, steppable
    for param in CASES:
        name, raw = param.values
        params = resolve_params(POLICIES[name], raw)
        if steppable(name, params) and POLICIES[name].check(STEP_T, 0, params) is None:
            yield param


@pytest.mark.parametrize("name, params", list(_steppable_cases()))
def test_stepper_reproduces_the_simulator_for_every_variant(name, params):
    """Every variant above, one step at a time through the Stepper (tests/test_stepping.py's
    check: the simulator's cache at every step, slot for slot) on GQA groups."""
    from test_stepping import T as STEP_T, check_stepper, qkv_field
    policy = POLICIES[name]
    params = resolve_params(policy, params)
    floor = policy.min_budget(params)
    for heads, kv_heads, gqa in [(2, 2, "mean"), (6, 2, "max"), (4, 2, "sum")]:
        field = qkv_field(heads, kv_heads, seed=heads + len(gqa) + 1)
        for P in (0, 7, STEP_T):
            for budget in sorted({floor, floor + 2, max(floor, STEP_T - 3)}):
                for kv in range(kv_heads):
                    check_stepper(name, params, field, kv, P, budget, gqa)
