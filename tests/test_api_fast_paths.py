"""The fast paths of a call on a dense matrix give the numbers of the general ones: the
plain decode loop (one dense head, no values, no snapshots), the prompt's column sums in
one kernel, and rows built only when asked for."""

from __future__ import annotations

import importlib
import pickle

import numpy as np
import pytest
from matrices import RECIPES, make_attention
from reference import reference_simulate

import kvsim
from kvsim.numerics.field import dense_field
from kvsim.numerics.fullpass import BLOCKS, full_pass
from kvsim.policies import POLICIES
from kvsim.policies.base import run_decode
from kvsim.protocols.run import make_group, resolve_params

api_simulate = importlib.import_module("kvsim.api.simulate")  # the module, not the function
T, P = 192, 96
H2O_VARIANTS = [{}, {"normalize": True}, {"accumulate": "full"}, {"recent_ratio": 0.25}]


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("params", H2O_VARIANTS)
def test_a_plain_h2o_run_is_the_general_loop_and_the_reference(recipe, params):
    A = make_attention(T, recipe, 3)
    for budget in (8, 40):
        kw = dict(policies=["h2o"], budgets=[budget], prompt_len=P, workers=1, **params)
        plain = kvsim.simulate(A, check=False, **kw)
        general = kvsim.simulate(A, record=("kept",), **kw)  # snapshots: the general loop
        mass = plain.mass("h2o", budget)
        assert np.array_equal(mass, general.mass("h2o", budget))
        assert np.array_equal(plain.series("cache_size", "h2o", budget),
                              general.series("cache_size", "h2o", budget))
        one = kvsim.simulate(A, "h2o", budget, P, check=False, **params)
        assert np.array_equal(one.mass, mass[0])
        last = general.kept("h2o", budget)[-1]
        assert np.array_equal(np.sort(last[last >= 0]), one.kept)
        if params.get("normalize") or params.get("accumulate") == "full":
            continue  # the general loop: tests/test_reference_match holds it to the reference
        ref = reference_simulate(A, "h2o", budget, P, **params)
        if not ref.near_tie:  # else the order is rounding noise (tests/test_reference_match)
            assert np.array_equal(one.kept, np.sort(ref.kept))
            assert np.allclose(one.mass, ref.mass, rtol=0, atol=1e-9)


@pytest.mark.parametrize("prompt_len", [1, 2, BLOCKS - 1, BLOCKS, BLOCKS + 1, 97, T])
def test_the_prompt_column_sums_of_a_dense_head_are_the_full_pass_numbers(prompt_len):
    """One kernel call sums the prompt rows block by block as the full pass does: the
    same bits as a pass over the prompt and one more row, and as a pass over every row."""
    field = dense_field(np.stack([make_attention(T, "softmax", 5),
                                  make_attention(T, "heavy", 6)]))
    for head in (0, 1):
        alone = full_pass(field, head, prompt_len, prompt_len)
        rows = min(prompt_len + 1, T)
        assert np.array_equal(alone.prompt_colsum,
                              full_pass(field, head, prompt_len, rows).prompt_colsum)
        assert np.array_equal(alone.prompt_colsum, full_pass(field, head, prompt_len).prompt_colsum)
        assert not alone.decode_colsum.any() and alone.decode_mass.shape == (T - prompt_len,)


def test_a_call_builds_its_rows_only_when_they_are_asked_for(monkeypatch):
    built = []
    row = api_simulate.result_row
    monkeypatch.setattr(api_simulate, "result_row",
                        lambda *args: built.append(args) or row(*args))
    A = make_attention(T, "softmax", 1)
    res = kvsim.simulate(A, policies=["h2o", "window"], budgets=[16, 32], prompt_len=P,
                         check=False)
    assert built == []
    copy = pickle.loads(pickle.dumps(res))  # before its rows are built
    assert built == [] and copy.to_csv() == res.to_csv() and len(built) == 8
    built.clear()
    res = kvsim.simulate(A, policies=["h2o", "window"], budgets=[16, 32], prompt_len=P,
                         check=False)
    assert res.series("mass", "h2o", 16).shape == (1, T - P)
    assert len(res) == 4 and len(built) == 4
    assert [r["unit"] for r in res.rows] == [0, 1, 2, 3] and len(built) == 4


def test_the_plain_loop_refuses_a_run_that_is_not_plain():
    A = make_attention(T, "softmax", 2)
    field = dense_field(np.stack([A, A]), kv_heads=1)  # two query heads share the cache
    group = make_group(field, 0, P, np.zeros((2, T), bool), {})
    spec = POLICIES["h2o"]
    kept, state = spec.steps.start(group, 16, resolve_params(spec, {}), T)
    with pytest.raises(ValueError, match="decode_plain: expected one dense head"):
        run_decode(group, 16, kept, spec.steps.plain.loop, state)
    assert run_decode(group, 16, kept, spec.steps.decode, state).mass.shape == (2, T - P)
