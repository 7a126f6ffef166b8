"""Every class of scenario problem becomes one clear line naming file and key path."""

import numpy as np
import pytest

from kvsim import ScenarioError, load_scenario
from kvsim.cli import main

BASE = """\
seeds = [0]
[attention]
source = "seed_notebook"
T = 64
important = 4
[policies.streaming_llm]
sinks = 4
[policies.snapkv]
window = 8
[[experiment]]
name = "e"
prompt_len = 32
budgets = [16]
"""


def problems(tmp_path, text: str, name: str = "s.toml") -> list[str]:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    lines = info.value.lines()
    assert all(line.startswith(f"{path}: ") for line in lines)
    return [line[len(str(path)) + 2:] for line in lines]


def test_base_is_valid(tmp_path):
    path = tmp_path / "ok.toml"
    path.write_text(BASE)
    scenario = load_scenario(path)
    assert scenario.T == 64 and scenario.experiments[0].budgets == (16,)


@pytest.mark.parametrize("old, new, expected", [
    # unknown keys, with a suggestion
    ("seeds = [0]", "seeds = [0]\nseed = 1", "seed: unknown key (did you mean 'seeds'?)"),
    ("T = 64", "T = 64\nimportnt = 3", "attention.importnt: unknown key (did you mean 'important'?)"),
    ("window = 8", "windw = 8", "policies.snapkv.windw: unknown key (did you mean 'window'?)"),
    ("prompt_len = 32", "promptlen = 32", "experiment[0].promptlen: unknown key (did you mean 'prompt_len'?)"),
    ("[policies.snapkv]", "[policies.snapkvv]", "policies.snapkvv: expected a policy name (did you mean 'snapkv'?)"),
    ('source = "seed_notebook"', 'source = "seed_notebok"', "attention.source: expected one of seed_notebook, matrix, field, trace (did you mean 'seed_notebook'?)"),
    # wrong types
    ("sinks = 4", 'sinks = "4"', "policies.streaming_llm.sinks: expected int, got '4'"),
    ("T = 64", "T = 64.0", "attention.T: expected int, got 64.0"),
    ("budgets = [16]", "budgets = 16", "experiment[0].budgets: expected a non-empty list"),
    ("budgets = [16]", 'budgets = ["16"]', "experiment[0].budgets[0]: expected a token count"),
    ("seeds = [0]", "seeds = [true]", "seeds: expected a non-empty list of distinct integers >= 0"),
    # out of range
    ("[policies.snapkv]", "[policies.snapkv]\nkernel = 4", "policies.snapkv.kernel: expected an odd integer >= 1, got 4"),
    ("[policies.snapkv]", '[policies.snapkv]\npooling = "median"', "policies.snapkv.pooling: expected one of 'max', 'avg', 'none', got 'median'"),
    ("prompt_len = 32", "prompt_len = 65", "experiment[0].prompt_len: expected an integer in [0, 64], got 65"),
    ("budgets = [16]", "budgets = [1.5]", "experiment[0].budgets[0]: expected a token count"),
    ("budgets = [16]", "budgets = [0]", "experiment[0].budgets[0]: expected a budget of at least 1 token"),
    ("budgets = [16]", "budgets = [0.01]", "experiment[0].budgets[0]: expected a budget of at least 1 token, got 0.01 (resolves to 0"),
    ("important = 4", "important = 65", "attention.important: expected at most T = 64, got 65"),
    # cross-field
    ("budgets = [16]", "budgets = [4]", "experiment[0].budgets[0]: policy 'streaming_llm': expected at least 5 for streaming_llm (its fixed parts + 1), got 4"),
    ("budgets = [16]", "budgets = [8]", "experiment[0].budgets[0]: policy 'snapkv': expected at least 9 for snapkv"),
    ("window = 8", "window = 8\nprotect_window = false", "policies.snapkv.protect_window: expected true when there are decode steps (prompt_len 32 < T 64), got false in experiment 'e'"),
    ('name = "e"', 'name = "e"\npolicies = ["h2o"]', "experiment[0].policies[0]: expected a [policies.NAME] defined in this file"),
    ('name = "e"', 'name = "e"\nfigures = "pareto"', "experiment[0].figures: expected a list of"),
])
def test_problem_lines(tmp_path, old, new, expected):
    assert old in BASE
    lines = problems(tmp_path, BASE.replace(old, new, 1))
    assert any(line.startswith(expected) for line in lines), lines


FIELD = """\
[attention]
source = "field"
T = 32
heads = 2
[[attention.boost]]
{boost}
queries = [10, 32]
[policies.window]
[[experiment]]
budgets = [4]
"""


@pytest.mark.parametrize("boost, expected", [
    ("keys = [3, 40]", "attention.boost[0].keys: expected a range within [0, 32], got [3, 40]"),
    ("key_positions = [3, 32]", "attention.boost[0].key_positions: expected positions below T = 32"),
    ("key_positions = []", "attention.boost[0].key_positions: expected at least one key"),
    ("keys = [1, 2]\nkey_positions = [3]", "attention.boost[0]: expected exactly one of keys"),
    ("keys = [5, 2]", "attention.boost[0].keys: expected [lo, hi] with 0 <= lo <= hi, got [5, 2]"),
])
def test_field_boost_problems(tmp_path, boost, expected):
    lines = problems(tmp_path, FIELD.format(boost=boost))
    assert any(line.startswith(expected) for line in lines), lines


@pytest.mark.parametrize("old, new, expected", [
    ("heads = 2", "heads = 2\nkv_heads = 3", "attention.kv_heads: expected a divisor of heads (2), got 3"),
    ("heads = 2", 'heads = 2\ngqa = "min"', "attention.gqa: expected one of 'mean', 'max', 'sum'"),
    ("heads = 2", "heads = 2\n[attention.sinks]\ncont = 2", "attention.sinks.cont: unknown key (did you mean 'count'?)"),
    ("heads = 2", "heads = 2\n[attention.noize]", "attention.noize: unknown key (did you mean 'noise'?)"),
    ("heads = 2", "heads = 2\n[[attention.head]]", "attention.head: expected one [[attention.head]] table per head (2), got 1"),
    ("heads = 2", "heads = 2\n[attention.heavy_hitters]\nhi = 40", "attention.heavy_hitters: expected positions and hi within [0, 32]"),
])
def test_field_problems(tmp_path, old, new, expected):
    text = FIELD.format(boost="keys = [1, 2]").replace(old, new, 1)
    lines = problems(tmp_path, text)
    assert any(line.startswith(expected) for line in lines), lines


def test_several_problems_are_all_reported(tmp_path):
    text = BASE.replace("sinks = 4", "sinks = -1").replace("seeds = [0]", "seeds = [0]\nnam = 'x'")
    lines = problems(tmp_path, text)
    assert len(lines) == 2


def test_unreadable_files(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "missing.toml")]) == 2
    assert "expected an existing scenario file" in capsys.readouterr().err
    lines = problems(tmp_path, "name = [", "broken.toml")
    assert lines[0].startswith("expected valid TOML")


MATRIX = """\
[attention]
source = "matrix"
path = "{path}"
[policies.window]
[[experiment]]
budgets = [2]
"""


def matrix_problem(tmp_path, array, **save) -> str:
    np.save(tmp_path / "m.npy", array)
    lines = problems(tmp_path, MATRIX.format(path="m.npy"))
    assert len(lines) == 1
    return lines[0]


def test_matrix_file_errors(tmp_path):
    good = np.tril(np.ones((4, 4)))
    good /= good.sum(axis=1, keepdims=True)
    assert "path: expected an existing" in problems(tmp_path, MATRIX.format(path="nope.npy"))[0]
    bad = good.copy()
    bad[1, 3] = 0.1
    assert matrix_problem(tmp_path, bad).startswith(
        "attention.path: head 0: expected a causal matrix (zero above the diagonal), row 1")
    bad = good.copy()
    bad[2, 0] += 0.5
    assert "expected rows summing to 1 (within 1e-05), row 2 sums to 1.5" in matrix_problem(tmp_path, bad)
    assert "expected a square" in matrix_problem(tmp_path, np.ones((3, 4)))
    bad = good.copy()
    bad[3, 0] = np.nan
    assert "expected finite values, row 3" in matrix_problem(tmp_path, bad)
    (tmp_path / "junk.npy").write_text("not numpy")
    assert "expected a readable .npy" in problems(tmp_path, MATRIX.format(path="junk.npy"))[0]


def test_matrix_paths_resolve_relative_to_scenario(tmp_path, monkeypatch):
    sub = tmp_path / "sub"
    sub.mkdir()
    p = np.tril(np.ones((5, 5)))
    np.savez(sub / "m.npz", attention=p / p.sum(axis=1, keepdims=True), important=[1, 3])
    (sub / "s.toml").write_text(MATRIX.format(path="m.npz"))
    monkeypatch.chdir(tmp_path)
    scenario = load_scenario("sub/s.toml")
    assert scenario.T == 5 and scenario.has_truth
