"""The step interface driven one step at a time (kvsim.protocols.stepping.Stepper).

For every registered policy with step code, a Stepper fed the simulator's own rows step
by step must reproduce the simulator's cache at every decode step exactly (same positions
in the same slots), on single heads and GQA groups, at P = 0, P = T and in between, at the
policy's smallest budget and above. Policies that cannot run in a closed loop must say
why in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from policy_checks import T, case_id, check_stepper, policy_cases, qkv_field, steppable

from kvsim.errors import KvsimError
from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params
from kvsim.protocols.stepping import Stepper

def stepping(name, params):
    """Whether the variant runs one step at a time here (decode steps from P = 0)."""
    params = resolve_params(POLICIES[name], params)
    return steppable(name, params) and POLICIES[name].check(T, 0, params) is None


# (query heads, KV heads, gqa, field seed, prompt lengths, budgets above the floor m)
GROUPS = [(2, 2, "mean", 6, (0, 1, 11, T), lambda m: (m, m + 3, T - 2)),
          (4, 2, "mean", 8, (0, 1, 11, T), lambda m: (m, m + 3, T - 2)),
          (4, 2, "max", 7, (0, 1, 11, T), lambda m: (m, m + 3, T - 2)),
          (6, 2, "sum", 9, (0, 1, 11, T), lambda m: (m, m + 3, T - 2)),
          (2, 2, "mean", 7, (0, 7, T), lambda m: (m, m + 2, max(m, T - 3))),
          (6, 2, "max", 10, (0, 7, T), lambda m: (m, m + 2, max(m, T - 3))),
          (4, 2, "sum", 8, (0, 7, T), lambda m: (m, m + 2, max(m, T - 3)))]


@pytest.mark.parametrize("name, params", policy_cases(keep=stepping))
def test_stepper_reproduces_the_simulator(name, params):
    """Every variant of the table, on single heads and GQA groups, at P = 0, P = T and in
    between, at the policy's smallest budget and above."""
    policy = POLICIES[name]
    params = resolve_params(policy, params)
    floor = policy.min_budget(params)
    compared = 0
    for heads, kv_heads, gqa, seed, prompts, budgets in GROUPS:
        field = qkv_field(heads, kv_heads, seed=seed)
        for P in prompts:
            if policy.check(T, P, params) is not None:
                continue
            for budget in sorted(set(budgets(floor))):
                if budget < floor:
                    continue
                for kv in range(kv_heads):
                    check_stepper(name, params, field, kv, P, budget, gqa)
                    compared += 1
    assert compared >= 7 * 2 * 2


@pytest.mark.parametrize("name", [pytest.param(n, id=case_id(n, {})) for n in POLICIES])
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
