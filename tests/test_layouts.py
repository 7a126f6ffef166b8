"""Every registered policy's declared state layout (``Policy.layout``) against its state:
the protocols read the declaration alone, so it must say what probing the state finds."""

from __future__ import annotations

import inspect

import numpy as np
import pytest
from policy_checks import SMALL_PARAMS, T, case_id, qkv_field, variants

from kvsim.errors import KvsimError
from kvsim.policies import POLICIES, ring
from kvsim.policies.layout import widen
from kvsim.protocols.run import make_group, resolve_params
from kvsim.protocols.stepping import Stepper

STEPPED = [pytest.param(name, params, id=case_id(name, params))
           for name, policy in POLICIES.items() if policy.steps is not None
           for params in [*variants(name), *([{"refresh": 3}] if name == "snapkv" else [])]]


def probe(name: str, params: dict, P: int, budget: int):
    """The states that ``start`` builds at ``budget`` and ``budget + 1`` (prompt ``P``)."""
    policy = POLICIES[name]
    field = qkv_field(2, 1, seed=P)
    group = make_group(field, 0, P, np.zeros((2, T), bool), {})
    return [policy.steps.start(group, b, params, T)[1] for b in (budget, budget + 1)]


def slot_fields(small, large) -> frozenset[str]:
    """The fields whose last axis grows with the budget: today's probe, kept as the check."""
    return frozenset(name for name, value in small._asdict().items()
                     if isinstance(value, np.ndarray) and value.ndim
                     and getattr(large, name).shape[-1] == value.shape[-1] + 1)


def pair_fields(small, large) -> frozenset[str]:
    """The fields whose last two axes grow with the budget (a matrix over the slots)."""
    return frozenset(name for name, value in small._asdict().items()
                     if isinstance(value, np.ndarray) and value.ndim >= 2
                     and getattr(large, name).shape[-2:] == (value.shape[-2] + 1,
                                                             value.shape[-1] + 1))


@pytest.mark.parametrize("name, given", STEPPED)
def test_every_declared_layout_matches_the_state_it_describes(name, given):
    policy = POLICIES[name]
    layout = policy.layout
    assert layout is not None, f"{name}: step code without a declared layout"
    params = resolve_params(policy, {**SMALL_PARAMS.get(name, {}), **given})
    budget = policy.min_budget(params) + 2
    for P in (budget + 9, 3):
        small, large = probe(name, params, P, budget)
        fields = set(small._fields)
        assert layout.slot_fields(params) == slot_fields(small, large), (name, P)
        assert layout.pairs == pair_fields(small, large), (name, P)
        assert layout.ring == ({"base", "start", "width"} <= fields), name
        assert layout.slot_of == ("slot_of" in fields), name
        assert layout.position_rule == (policy.steps.decode is ring.decode), name
        if layout.recent is not None:
            assert small.recent == layout.recent(budget, params), name
            if policy.run_capped is not None:  # a cap keeps the mean budget's count
                assert "recent" in inspect.signature(policy.steps.start).parameters
        kept = policy.steps.start(make_group(qkv_field(2, 1, seed=P), 0, P,
                                             np.zeros((2, T), bool), {}), budget, params, T)[0]
        assert all(k in kept for k in range(min(layout.sinks(params), P))), name


@pytest.mark.parametrize("name, given", STEPPED)
def test_a_widened_state_is_the_state_of_the_wider_budget_in_shape(name, given):
    """Widening by ``extra`` slots gives each per-slot field the wider budget's shape and
    leaves every other field as it was (the fixed parts stay the budget's)."""
    policy = POLICIES[name]
    params = resolve_params(policy, {**SMALL_PARAMS.get(name, {}), **given})
    budget = policy.min_budget(params) + 2
    small, _ = probe(name, params, budget + 9, budget)
    wide = widen(small, policy.layout, params, budget, 3, seed=1)
    larger = probe(name, params, budget + 9, budget + 3)[0]
    slots = policy.layout.slot_fields(params)
    for field, value in small._asdict().items():
        if field in slots:
            assert getattr(wide, field).shape == getattr(larger, field).shape, (name, field)
        elif field == "width" and policy.layout.ring:
            assert wide.width == small.width + 3
        elif field == "slots" and policy.layout.widen is not None:
            assert wide.slots.max() < budget + 3 and wide.slots.shape == small.slots.shape
        elif isinstance(value, np.ndarray):
            assert getattr(wide, field) is value, (name, field)
        else:
            assert getattr(wide, field) == value, (name, field)


def test_a_policy_without_a_layout_takes_no_protocol(monkeypatch):
    """A policy registered without a layout runs its per-step rule; a protocol, which would
    have to move its state, is a one-line refusal."""
    import dataclasses

    import kvsim

    monkeypatch.setitem(POLICIES, "bare", dataclasses.replace(POLICIES["tova"], name="bare",
                                                              layout=None))
    A = np.tril(np.ones((12, 12)))
    A /= A.sum(axis=1, keepdims=True)
    assert kvsim.simulate(A, "bare", 4, 6).cache_size.max() == 4
    with pytest.raises(KvsimError, match=r"^bare.interval: bare takes no protocol \(interval\): "
                                         r"it declares no state layout \(Policy.layout\)"):
        kvsim.simulate(A, "bare", 4, 6, interval=2)
    stepper = Stepper("bare", 4, prompt_attention=A[None, :6, :6], capacity_T=12)
    with pytest.raises(KvsimError, match="^bare: cannot widen: it declares no state layout"):
        stepper.widen(2)
