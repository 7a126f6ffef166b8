"""Every registered policy matches the plain reference (tests/reference.py) on sources with
vectors (random q.k fields with values, real trace heads) and dense matrices, with GQA.

Driven by the registry and the one table of cases (``REFERENCES`` in tests/reference.py): a
new policy is tested here by being registered (its reference entry must exist, or these
tests fail); the ids hold ``policy-check-<name>``. Exact means: the same cache at every decode step, the same
final kept set, per-step mass, output error and recall within 1e-9 for every query head. A
decision that hinged on a rounding-level near tie (see reference.NEAR_TIE_RTOL) may differ:
it is then reported as a NearTieWarning, the cache sizes still compared.
"""

from __future__ import annotations

import numpy as np
import pytest
from matrices import make_attention
from policy_checks import (SMALL_PARAMS, case_id, check, field_source, heads, min_budget,
                           policy_cases, qk_field, trace_field, valid)
from reference import dense_source

import kvsim
from kvsim import ScenarioError, load_scenario
from kvsim.errors import KvsimError
from kvsim.numerics.field import dense_field
from kvsim.policies import POLICIES
from kvsim.protocols.run import NEED_WORDS

CASES = policy_cases()
ATTENTION_ONLY = policy_cases(attention_only=True)


def budgets(name, params, T, rng):
    m = min_budget(name, params)
    return sorted({m, m + 1, int(rng.integers(m, max(m, T) + 3)), max(m, T)})


@pytest.mark.parametrize("name, params", CASES)
@pytest.mark.parametrize("seed", range(6))
def test_random_qk_fields(name, params, seed):
    """Random q.k fields with values: 1-3 query heads per KV head, every gqa rule."""
    rng = np.random.default_rng([seed, len(name), len(params)])
    G = int(rng.integers(1, 4)) if heads(name) else 1
    T = int(rng.integers(2, 36))
    kind = ("gauss", "ints", "pool")[seed % 3]
    field = qk_field(rng, T, G, kind=kind)
    src = field_source(field)
    gqa = ("mean", "max", "sum")[seed % 3]
    for P in sorted({0, int(rng.integers(0, T + 1)), T}):
        for B in budgets(name, params, T, rng):
            if valid(name, params, T, P):
                check(field, src, name, params, B, P, gqa, important=rng.choice(T, 3))


@pytest.mark.parametrize("name, params", ATTENTION_ONLY)
@pytest.mark.parametrize("recipe", ["softmax", "heavy", "quantised", "onehot", "sparse_ties"])
def test_dense_matrices(name, params, recipe):
    """Policies that need only attention, on dense matrices (one or two query heads)."""
    G = 2 if heads(name) else 1
    T = 30
    probs = np.stack([make_attention(T, recipe, 7 + g) for g in range(G)])
    field = dense_field(probs, 1)
    src = dense_source(probs)
    rng = np.random.default_rng(len(recipe))
    for P in (0, 11, 24, T):
        for B in budgets(name, params, T, rng):
            if valid(name, params, T, P):
                check(field, src, name, params, B, P, ("mean", "max", "sum")[P % 3],
                      important=[0, 5, 17])


@pytest.mark.parametrize("name, params", CASES)
def test_real_trace_heads(name, params):
    """Heads of the committed SmolLM2 trace (3 query heads per KV head), first 64 tokens."""
    rng = np.random.default_rng(3)
    for layer, kv in ((0, 1), (2, 0)):
        field = trace_field(layer, kv, 64)
        if not heads(name):  # one query head of the group
            field = field._replace(queries=field.queries[:1], qk_scale=field.qk_scale[:1],
                                   key_bias=field.key_bias[:1], distance=field.distance[:1],
                                   noise_kind=field.noise_kind[:1],
                                   noise_scale=field.noise_scale[:1],
                                   noise_key=field.noise_key[:1], group=1)
        src = field_source(field)
        for P in (0, 40, 64):
            for B in budgets(name, params, 64, rng):
                if valid(name, params, 64, P):
                    check(field, src, name, params, B, P, "mean", important=[0, 3, 50])


@pytest.mark.parametrize("name, params", CASES)
def test_min_budget_and_tiny_sequences(name, params):
    rng = np.random.default_rng(5)
    m = min_budget(name, params)
    for T in (1, 2, 3, 5):
        field = qk_field(rng, T, 2 if heads(name) else 1)
        src = field_source(field)
        for P in range(T + 1):
            if valid(name, params, T, P):
                check(field, src, name, params, m, P, "max", important=[T - 1])


NEEDING = [pytest.param(n, id=case_id(n, {})) for n, p in POLICIES.items() if p.needs]


@pytest.mark.parametrize("name", NEEDING)
def test_dense_matrix_is_a_one_line_error(name):
    A = make_attention(80, "softmax", 0)
    with pytest.raises(KvsimError) as info:  # parameters that fit the budget (openvino_arkv)
        kvsim.simulate(A, policies={name: {"kind": name, **SMALL_PARAMS.get(name, {})}},
                       budgets=[64], prompt_len=6)
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
budgets = [48]
"""


@pytest.mark.parametrize("name", NEEDING)
def test_scenario_source_without_vectors_is_a_one_line_error(tmp_path, name):
    path = tmp_path / "s.toml"
    small = "".join(f"{k} = {v}\n" for k, v in SMALL_PARAMS.get(name, {}).items())
    path.write_text(SCENARIO.format(name=name).replace(f"[policies.{name}]\n",
                                                       f"[policies.{name}]\n{small}"))
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    needs = " and ".join(NEED_WORDS[n] for n in sorted(POLICIES[name].needs))
    assert info.value.lines() == [f"{path}: experiment[0].policies[0]: policy {name!r}: {name} "
                                  f"needs {needs}, which the 'seed_notebook' attention source "
                                  f"does not have"]
