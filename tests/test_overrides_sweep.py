"""Command-line overrides against the file's [sweep]: the override wins and says so."""

import pytest

import kvsim
from kvsim.cli import main
from kvsim.scenario.overrides import Overrides

SCENARIO = """\
name = "swept"
seeds = [0]

[attention]
source = "field"
T = 64
heads = 1

[attention.heavy_hitters]
count = 4
exponent = 0.8

[policies.h2o]
[policies.window]

[[experiment]]
name = "decode"
prompt_len = 32
budgets = [8, 16]

[sweep]
"policies.h2o.recent_ratio" = [0.25, 0.75]
"attention.heavy_hitters.exponent" = [0.5, 1.5]
"experiment.prompt_len" = [24, 32]
budgets = [4, 12]
seeds = [5, 6]
"""


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "swept.toml"
    p.write_text(SCENARIO)
    return p


def notes(capsys) -> list[str]:
    return capsys.readouterr().err.splitlines()


def test_without_overrides_the_sweep_runs(path, capsys):
    variants = kvsim.load_sweep(path, Overrides())
    assert len(variants) == 4 and variants[0].seeds == (5, 6)
    assert variants[0].experiments[0].budgets == (4, 12)
    assert notes(capsys) == []


def test_set_replaces_a_field_axis(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(settings=[("attention.heavy_hitters.exponent",
                                                           1.2)]))
    assert [v.variant for v in variants] == [{"experiment.prompt_len": 24},
                                             {"experiment.prompt_len": 32}]
    assert all(v.attention["per_head"][0]["heavy_hitters"]["exponent"] == 1.2 for v in variants)
    (line,) = notes(capsys)
    assert "--set attention.heavy_hitters.exponent=1.2 replaces the file's sweep over " \
           "attention.heavy_hitters.exponent ([0.5, 1.5])" in line and str(path) in line


def test_set_replaces_a_policy_axis(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(settings=[("policies.h2o.recent_ratio", 0.4)]))
    (h2o, window) = variants[0].experiments[0].policies
    assert h2o.label == "h2o" and h2o.params["recent_ratio"] == 0.4
    assert "policies.h2o.recent_ratio" in notes(capsys)[0]


def test_set_of_a_whole_table_replaces_the_axes_inside_it(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(settings=[("attention.heavy_hitters",
                                                           {"count": 2, "exponent": 2.0})]))
    assert len(variants) == 2
    assert variants[0].attention["per_head"][0]["heavy_hitters"]["exponent"] == 2.0
    assert len(notes(capsys)) == 1


def test_budgets_replace_the_budget_axis(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(budgets=[6, 10]))
    assert variants[0].experiments[0].budgets == (6, 10)
    (line,) = notes(capsys)
    assert "--budgets 6,10 replaces the file's sweep over budgets ([4, 12])" in line


def test_seeds_replace_the_seed_axis(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(seeds=[1, 2, 3]))
    assert variants[0].seeds == (1, 2, 3)
    (line,) = notes(capsys)
    assert "--seeds 1,2,3 replaces the file's sweep over seeds ([5, 6])" in line


def test_policies_drop_the_axes_of_policies_not_run(path, capsys):
    variants = kvsim.load_sweep(path, Overrides(policies=["window"]))
    assert [p.label for p in variants[0].experiments[0].policies] == ["window"]
    (line,) = notes(capsys)
    assert "--policies window does not run 'h2o'" in line
    variants = kvsim.load_sweep(path, Overrides(policies=["h2o"]))  # the sweep of h2o stays
    assert [p.label for p in variants[0].experiments[0].policies] == [
        "h2o[recent_ratio=0.25]", "h2o[recent_ratio=0.75]"]
    assert notes(capsys) == []


def test_an_override_the_sweep_would_partly_overwrite_is_refused(path):
    with pytest.raises(kvsim.ScenarioError, match=r"--set: expected a key the file's \[sweep\] "
                       r"does not overwrite, got experiment\[0\].prompt_len \(the sweep varies "
                       r"experiment.prompt_len"):
        kvsim.load_sweep(path, Overrides(settings=[("experiment[0].prompt_len", 30)]))


def test_cli_says_so_on_one_line(capsys):
    status = main(["validate", "scenarios/heavy_hitters.toml",
                   "--set", "attention.heavy_hitters.exponent=1.2"])
    out, err = capsys.readouterr()
    assert status == 0 and "(1 field variant(s)" in out
    assert err.splitlines() == ["kvsim: scenarios/heavy_hitters.toml: --set "
                                "attention.heavy_hitters.exponent=1.2 replaces the file's sweep "
                                "over attention.heavy_hitters.exponent ([0.8, 1.2])"]
