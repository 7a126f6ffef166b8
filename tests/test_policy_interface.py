"""What a policy declares: what it needs from its source, checked before anything runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import kvsim
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.policies import POLICIES, Policy

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
    assert all(p.needs <= {"keys", "values", "queries"} for p in POLICIES.values())
