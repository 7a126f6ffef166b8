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
from policy_checks import T, check_stepper, qkv_field, steppable

from kvsim.errors import KvsimError
from kvsim.policies import POLICIES
from kvsim.policies.run import resolve_params
from kvsim.policies.stepping import Stepper

# Extra parameter sets (every registered policy also runs with its defaults).
VARIANTS = {
    "streaming_llm": [{"sinks": 1}],
    "h2o": [{"recent_ratio": 0.0}, {"recent_ratio": 0.25, "normalize": True}],
    "snapkv": [{"window": 3, "kernel": 3}, {"window": 1, "pooling": "avg"}],
}


def cases():
    for name, policy in POLICIES.items():
        for raw in [{}] + VARIANTS.get(name, []):
            params = resolve_params(policy, raw)
            if steppable(name, params) and policy.check(T, 0, params) is None:
                yield pytest.param(name, params, id=f"{name}-{raw}".replace(" ", ""))


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
