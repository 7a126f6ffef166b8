"""Checks shared by the policy tests: the cases of the one table (``REFERENCES`` in
tests/reference.py), a policy run by kvsim against the plain reference, and the
step-by-step driver against the simulator."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
from matrices import make_attention
from reference import REFERENCES, RopeSource, qk_source, reference_run

from kvsim.numerics.decode import observed_outputs
from kvsim.numerics.field import FieldData, dense_field, empty_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.lanes import lane_sum
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params, run_policy
from kvsim.protocols.stepping import Stepper


TRACE = Path(__file__).parent.parent / "scenarios" / "traces" / "smollm2_gpl3.npz"

# Parameters that fit every registered policy into the small budgets (5 and up) of the
# tests that run the whole registry on small fields.
SMALL_PARAMS = {name: entry.small for name, entry in REFERENCES.items() if entry.small}


def case_id(name: str, params: dict) -> str:
    """``policy-check-<name>-<variant>``: ``pytest -k policy-check`` selects every case,
    ``-k "policy-check and knorm"`` one policy's (``-k policy-check-h2o-`` h2o alone)."""
    return f"policy-check-{name}-" + ("-".join(f"{k}={v}" for k, v in params.items())
                                      or "defaults")


def variants(name: str) -> list[dict]:
    """The defaults ({}) and the table's variants of a policy (by name)."""
    entry = REFERENCES.get(name)
    return [{}] + list(entry.variants if entry else ())


def policy_cases(attention_only: bool = False, keep=None) -> list:
    """``pytest.param(name, params)`` for every registered policy and variant of the table
    (``attention_only``: the policies that need nothing but attention; ``keep(name, params)``:
    a filter)."""
    return [pytest.param(name, params, id=case_id(name, params))
            for name, policy in POLICIES.items() if not (attention_only and policy.needs)
            for params in variants(name) if keep is None or keep(name, params)]


def heads(name: str) -> bool:
    """Whether the policy's reference runs on GQA groups (several query heads)."""
    entry = REFERENCES.get(name)
    return entry is not None and entry.gqa


def valid(name: str, params: dict, T: int, P: int) -> bool:
    """Whether the policy takes this prompt length (snapkv without its protected window: the
    whole sequence; expected_attention: a prompt query after its sinks if it decodes)."""
    policy = POLICIES[name]
    return policy.check(T, P, resolve_params(policy, params)) is None


def min_budget(name: str, params: dict) -> int:
    """The policy's smallest budget with these parameters."""
    policy = POLICIES[name]
    return policy.min_budget(resolve_params(policy, params))


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
    # a RoPE for the policies that need one (no draw: the other policies' cases stay): the
    # queries stand for their own pre-RoPE vectors, rotated by scaled frequencies
    f["pre_rope_queries"] = f["queries"]
    f["rope_freq"] = 1.0 / 10.0 ** (np.arange(d // 2) / max(d // 2, 1))
    f["rope_scale"] = 1.25
    return FieldData(**f)


def trace_field(layer: int, kv: int, T: int) -> FieldData:
    """KV head ``kv`` of layer ``layer`` (its index in the file) of the committed SmolLM2
    trace with its query heads, first ``T`` tokens."""
    with np.load(TRACE) as data:
        q, k, v = data["queries"], data["keys"], data["values"]
        scale = float(data["scaling"])
        rope = {n: data[n] for n in ("pre_rope_queries", "rope_freq", "rope_scale")
                if n in data.files}
    G = q.shape[1] // k.shape[1]
    f = empty_field(G, T, 1)
    f["queries"] = np.ascontiguousarray(q[layer, kv * G:(kv + 1) * G, :T], np.float32)
    f["keys"] = np.ascontiguousarray(k[layer, kv:kv + 1, :T].transpose(0, 2, 1), np.float32)
    f["values"] = np.ascontiguousarray(v[layer, kv:kv + 1, :T], np.float32)
    f["value_heads"] = np.ones(1, bool)
    f["qk_scale"] = np.full(G, scale)
    if rope:  # capture version 3
        f["pre_rope_queries"] = np.ascontiguousarray(
            rope["pre_rope_queries"][layer, kv * G:(kv + 1) * G, :T], np.float32)
        f["rope_freq"], f["rope_scale"] = rope["rope_freq"][layer], float(rope["rope_scale"][layer])
    return FieldData(**f)


def field_source(field: FieldData):
    """The reference's source for KV head 0 of a q.k field (with its RoPE, if any)."""
    values = field.values[0] if field.has_values(0) else None
    src = qk_source(field.queries, field.keys[0].T, values, field.qk_scale)
    if field.pre_rope_queries.shape[2] == 0:
        return src
    return RopeSource(src.probs, src.keys, src.values, src.queries, src.scaling,
                      field.pre_rope_queries.astype(np.float64), field.rope_freq,
                      field.rope_scale)


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


T = 24  # the sequence length of the step-by-step checks


def steppable(name: str, params: dict) -> bool:
    policy = POLICIES[name]
    return policy.steps is not None and policy.closed_loop(params) is None


def qkv_field(heads: int, kv_heads: int, seed: int):
    """Dense probabilities (with exact ties) plus key, query and value vectors."""
    rng = np.random.default_rng(seed)
    recipes = ("quantised", "heavy", "onehot", "softmax")
    A = np.stack([make_attention(T, recipes[(seed + h) % 4], seed * 7 + h) for h in range(heads)])
    d = 4
    return dense_field(A, kv_heads)._replace(
        keys=rng.standard_normal((kv_heads, d, T)).astype(np.float32),
        queries=rng.standard_normal((heads, T, d)).astype(np.float32),
        values=rng.standard_normal((kv_heads, T, d)).astype(np.float32),
        value_heads=np.ones(kv_heads, bool),
        qk_scale=rng.choice([-1.0, 1.0], heads) * rng.uniform(0.3, 2.0, heads))._replace(
        pre_rope_queries=rng.standard_normal((heads, T, d)).astype(np.float32),  # a RoPE,
        rope_freq=np.array([1.0, 0.1]), rope_scale=1.0)  # drawn after the rest


def check_stepper(name: str, params: dict, field, kv: int, P: int, budget: int, gqa: str):
    """The Stepper against the simulator on KV head ``kv``: per-step caches, slot for slot."""
    policy = POLICIES[name]
    steps = np.arange(T - P)
    group = make_group(field, kv, P, np.zeros((field.heads, T), bool), {}, GQA_MODES[gqa],
                       seed=5, snap_budget=budget, snap_steps=steps)
    trace = policy.run(group, budget, params)
    A = field.probs[group.heads]
    keys, values = field.keys[kv].T, field.values[kv]  # (T, d) rows, as a model has them
    queries = field.queries[group.heads] if "queries" in policy.needs else None
    rope = (field.pre_rope_queries[group.heads, :P], field.rope_freq, field.rope_scale)
    attention = {"prompt_attention": A[:, :P, :P].copy()}
    if policy.layer:  # the layer's attention, every KV head's group, and this KV head
        H_kv = field.heads // field.group
        attention = {"prompt_attention": field.probs[:, :P, :P].reshape(
            H_kv, field.group, P, P).copy(), "kv_head": kv}
    stepper = Stepper(name, budget, params, **attention, keys=keys,
                      values=values, queries=queries, scaling=field.qk_scale[group.heads],
                      gqa=gqa, seed=5, capacity_T=T, rope=rope)
    if P == T:
        assert np.array_equal(np.sort(stepper.cache), trace.kept)
    for step, t in enumerate(range(P, T)):
        before = set(stepper.cache.tolist())
        evicted = stepper.admit(t)
        cache = stepper.cache
        n = len(cache)
        assert np.array_equal(cache, trace.snapshots[step, :n]), (name, t)
        assert (trace.snapshots[step, n:] == -1).all()
        assert t in cache and n <= budget
        assert set(cache.tolist()) == (before | {t}) - {evicted}
        assert evicted == -1 if n > len(before) else evicted in before
        obs = np.ascontiguousarray(A[:, t, cache])  # the open loop: full rows over the cache
        mass = np.array([lane_sum(row, n) for row in obs])
        output = np.empty((len(obs), values.shape[1]))
        observed_outputs(values, cache, n, obs, mass, output)  # the loop's own o~
        stepper.observe(obs, output)
    assert np.array_equal(np.sort(stepper.cache), trace.kept)
