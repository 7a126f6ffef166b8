"""What a policy declares (what it needs from its source, checked before anything runs),
and the README's example policy, run as written."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from matrices import make_attention
from policy_checks import T as T_STEP
from policy_checks import case_id, check_stepper, qk_field, qkv_field

import kvsim
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.policies import POLICIES, Policy
from kvsim.protocols.run import make_group, resolve_params, run_policy

SCENARIO = """\
[attention]
source = "{source}"
T = 16
{extra}
[policies.needy]

[[experiment]]
prompt_len = 8
budgets = [4]
figures = []
"""


def needy(needs: set) -> Policy:
    """``window`` under another name, declaring that it needs ``needs``."""
    return dataclasses.replace(POLICIES["window"], name="needy", needs=frozenset(needs))


@pytest.mark.parametrize("needs, words", [({"keys"}, "key vectors"),
                                          ({"values", "keys"}, "key vectors and value vectors"),
                                          ({"queries"}, "query vectors")])
def test_a_policy_needing_vectors_on_a_dense_matrix_is_a_one_line_error(monkeypatch, needs, words):
    monkeypatch.setitem(POLICIES, "needy", needy(needs))
    A = np.tril(np.ones((8, 8))) / np.arange(1, 9)[:, None]
    with pytest.raises(KvsimError) as err:
        kvsim.simulate(A, "needy", 4, 4)
    assert str(err.value) == f"needy: needs {words}, which a dense attention matrix does not have"


def test_the_scenario_check_names_the_policy_and_the_source(monkeypatch, tmp_path: Path, capsys):
    monkeypatch.setitem(POLICIES, "needy", needy({"values"}))
    for source, extra, ok in [("seed_notebook", "important = 2\n", False),
                              ("field", "[attention.qk]\ndim = 4\nvalues = false\n", False),
                              ("field", "[attention.qk]\ndim = 4\n", True)]:
        path = tmp_path / "needy.toml"
        path.write_text(SCENARIO.format(source=source, extra=extra))
        if ok:
            assert kvsim.load_scenario(path).experiments[0].policies[0].kind == "needy"
            continue
        out = tmp_path / "out"
        assert main([str(path), "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == (f"{path}: experiment[0].policies[0]: policy 'needy': needy needs value "
                       f"vectors, which the {source!r} attention source does not have")
        assert not out.exists()


def test_needs_are_declared_from_a_known_set():
    with pytest.raises(ValueError, match="not in"):
        dataclasses.replace(POLICIES["window"], needs=frozenset({"gradients"}))
    assert all(p.needs <= {"keys", "values", "queries", "rope"} for p in POLICIES.values())


# ---------------------------------------------------------------------------------------
# The manual's example of a policy with a state of its own (docs/policies.md), as written


def readme_example(tmp_path: Path):
    """The manual's example policy module, imported from a file (so that Numba caches it)."""
    readme = (Path(__file__).parents[1] / "docs" / "policies.md").read_text()
    section = readme.split("## Adding a policy", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert len(code.splitlines()) <= 60
    path = tmp_path / "decayed_example.py"
    path.write_text(code)
    spec = importlib.util.spec_from_file_location("decayed_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def decayed_reference(A: np.ndarray, P: int, B: int, decay: float) -> list[list[int]]:
    """The example's rule in plain Python: the cached positions after each admission."""
    score = {k: A[:P, k].sum() for k in range(P)}
    cache = sorted(range(P), key=lambda k: (-score[k], k))[:B]
    caches = []
    for t in range(P, A.shape[0]):
        if len(cache) == B:
            cache.remove(min(cache, key=lambda k: (score[k], -k)))  # lowest; ties: newest
        cache.append(t)
        score[t] = 0.0
        caches.append(sorted(cache))
        m = sum(A[t, k] for k in cache)
        for k in cache:
            score[k] = decay * score[k] + (A[t, k] / m if m > 0 else 0.0)
    return caches


def test_the_readme_example_policy_runs_and_matches_its_reference(monkeypatch, tmp_path):
    module = readme_example(tmp_path)
    monkeypatch.setitem(POLICIES, "decayed", module.POLICY)
    compared = 0
    for seed in range(6):
        T = 20
        # sums exact in any order (no rounding ties), and exact ties to break
        A = make_attention(T, ("quantised", "onehot", "sparse_ties")[seed % 3], seed)
        for P, B, decay in [(0, 3, 0.9), (7, 4, 0.5), (12, 12, 0.9), (T, 5, 0.9), (9, 1, 0.0)]:
            ref = decayed_reference(A, P, B, decay)
            got = kvsim.simulate(A, "decayed", B, P, decay=decay)
            mass = [A[t, c].sum() for t, c in zip(range(P, T), ref)]
            assert np.allclose(got.mass, mass, rtol=0, atol=1e-12), (seed, P, B)
            final = ref[-1] if ref else sorted(np.argsort(-A[:P, :P].sum(0), kind="stable")[:B])
            assert got.kept.tolist() == final, (seed, P, B)
            compared += 1
    assert compared == 30
    # ... and one step at a time, on GQA groups too
    for heads, gqa in [(2, "mean"), (4, "max")]:
        field = qkv_field(heads, 2, seed=heads)
        for P, B in [(0, 1), (11, 4), (T_STEP, 6)]:
            for kv in range(2):
                check_stepper("decayed", {"decay": 0.9}, field, kv, P, B, gqa)


FLOORED = [pytest.param(name, id=case_id(name, {})) for name, policy in POLICIES.items()
           if policy.min_budget(resolve_params(policy, {})) > 1]


@pytest.mark.parametrize("name", FLOORED)
def test_run_policy_refuses_a_budget_below_the_minimum(name):
    """Below its minimum budget a policy's kernel would write out of bounds (and crash a
    later test): the internal runner raises the one-line error first. The sequence fits the
    budget, so that without the check the run returns instead of raising."""
    policy = POLICIES[name]
    params = resolve_params(policy, {})
    budget = policy.min_budget(params) - 1
    field = qk_field(np.random.default_rng(2), budget, 2)
    group = make_group(field, 0, budget, np.zeros((2, budget), bool), {})
    with pytest.raises(KvsimError) as info:
        run_policy(policy, group, budget, params)
    message = str(info.value)
    assert message.startswith(f"budget: expected at least {budget + 1} for {name}")
    assert message.endswith(f"got {budget}") and "\n" not in message
