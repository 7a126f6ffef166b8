"""The step interface driven one step at a time (kvsim.policies.stepping.Stepper).

For every registered policy with step code, a Stepper fed the simulator's own rows step
by step must reproduce the simulator's cache at every decode step exactly (same positions
in the same slots), on single heads and GQA groups, at P = 0, P = T and in between, at the
policy's smallest budget and above. Policies that cannot run in a closed loop must say
why in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from matrices import make_attention

from kvsim.errors import KvsimError
from kvsim.numerics.decode import observed_outputs
from kvsim.numerics.field import dense_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.lanes import lane_sum
from kvsim.policies import POLICIES
from kvsim.policies.run import make_group, resolve_params
from kvsim.policies.stepping import Stepper

# Extra parameter sets (every registered policy also runs with its defaults).
VARIANTS = {
    "streaming_llm": [{"sinks": 1}],
    "h2o": [{"recent_ratio": 0.0}, {"recent_ratio": 0.25, "normalize": True}],
    "snapkv": [{"window": 3, "kernel": 3}, {"window": 1, "pooling": "avg"}],
}
T = 24


def steppable(name: str, params: dict) -> bool:
    policy = POLICIES[name]
    return policy.steps is not None and policy.closed_loop(params) is None


def cases():
    for name, policy in POLICIES.items():
        for raw in [{}] + VARIANTS.get(name, []):
            params = resolve_params(policy, raw)
            if steppable(name, params) and policy.check(T, 0, params) is None:
                yield pytest.param(name, params, id=f"{name}-{raw}".replace(" ", ""))


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
        value_heads=np.ones(kv_heads, bool))


def check_stepper(name: str, params: dict, field, kv: int, P: int, budget: int, gqa: str):
    """The Stepper against the simulator on KV head ``kv``: per-step caches, slot for slot."""
    policy = POLICIES[name]
    steps = np.arange(T - P)
    group = make_group(field, kv, P, np.zeros((field.heads, T), bool), {}, GQA_MODES[gqa],
                       seed=5, snap_budget=budget, snap_steps=steps)
    trace = policy.run(group, budget, params)
    A = field.probs[group.heads]
    keys, values = field.keys[kv].T, field.values[kv]  # (T, d) rows, as a model has them
    stepper = Stepper(name, budget, params, prompt_attention=A[:, :P, :P].copy(), keys=keys,
                      values=values, gqa=gqa, seed=5, capacity_T=T)
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


@pytest.mark.parametrize("name, params", list(cases()))
def test_stepper_reproduces_the_simulator(name, params):
    policy = POLICIES[name]
    compared = 0
    for heads, kv_heads, gqa in [(2, 2, "mean"), (4, 2, "mean"), (4, 2, "max"), (6, 2, "sum")]:
        field = qkv_field(heads, kv_heads, seed=heads + len(gqa))
        floor = policy.min_budget(params)
        for P in (0, 1, 11, T):
            if policy.check(T, P, params) is not None:
                continue
            for budget in (floor, floor + 3, T - 2):
                if budget < floor:
                    continue
                for kv in range(kv_heads):
                    check_stepper(name, params, field, kv, P, budget, gqa)
                    compared += 1
    assert compared >= 4 * 4 * 2


@pytest.mark.parametrize("name", list(POLICIES))
def test_unsteppable_policies_say_why_in_one_line(name):
    policy = POLICIES[name]
    params = resolve_params(policy, {})
    variants = [params] + ([dict(params, accumulate="full")] if "accumulate" in params else [])
    for p in variants:
        if steppable(name, p):
            continue
        with pytest.raises(KvsimError) as err:
            Stepper(name, 8, p, prompt_attention=np.ones((1, 1, 1)), capacity_T=4)
        message = str(err.value)
        assert message.startswith(f"{name}: cannot run one step at a time: ") and "\n" not in message


def test_stepper_rejects_bad_use():
    A = np.ones((1, 1, 1))
    with pytest.raises(KvsimError, match="prompt_attention: expected shape"):
        Stepper("window", 4, prompt_attention=np.ones((1, 2, 3)), capacity_T=8)
    with pytest.raises(KvsimError, match="budget: expected at least 5 for streaming_llm"):
        Stepper("streaming_llm", 4, prompt_attention=A, capacity_T=8)
    with pytest.raises(KvsimError, match="capacity_T: expected an integer >= P"):
        Stepper("window", 4, prompt_attention=np.ones((1, 3, 3)), capacity_T=2)
    stepper = Stepper("window", 4, prompt_attention=A, capacity_T=3)
    with pytest.raises(KvsimError, match="observe: expected a token admitted first"):
        stepper.observe(np.ones((1, 1)))
    with pytest.raises(KvsimError, match="admit: expected token 1"):
        stepper.admit(2)
    assert stepper.admit(1) == -1
    with pytest.raises(KvsimError, match="admit: token 1 was admitted but not observed"):
        stepper.admit(2)
    with pytest.raises(KvsimError, match=r"attention: expected shape \(1, 2\)"):
        stepper.observe(np.ones((1, 3)))
    stepper.observe(np.full((1, 2), 0.5))
    stepper.admit(2)
    stepper.observe(np.full((1, 3), 1 / 3))
    with pytest.raises(KvsimError, match="below capacity_T = 3"):
        stepper.admit(3)
