"""The command line end to end on a small scenario: outputs, atomic replace, errors."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvsim.cli import _run_parser, main
from kvsim.policies import POLICIES

ROOT = Path(__file__).resolve().parents[1]

SMALL = """\
name = "small"
seeds = [0, 1]

[attention]
source = "seed_notebook"
T = 48
important = 6

[policies.streaming_llm]
sinks = 2
[policies.h2o]
[policies.full]
[policies.oracle]

[[experiment]]
name = "decode"
prompt_len = 16
budgets = [8, 0.75]
"""


@pytest.fixture
def scenario(tmp_path) -> Path:
    path = tmp_path / "small.toml"
    path.write_text(SMALL)
    return path


def test_run_writes_report(scenario, tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(scenario), "--out", str(out), "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    rows = list(csv.DictReader(open(out / "results.csv")))
    assert len(rows) == 4 * 2 * 2  # policies x budgets x seeds
    assert {int(r["budget"]) for r in rows} == {8, 12}  # 0.75 of a 16-token prompt
    full = [float(r["mass_min"]) for r in rows if r["policy"] == "full"]
    assert np.allclose(full, 1.0)
    steps = np.load(out / "steps.npz")
    assert steps["decode/mass"].shape == (16, 32)
    assert (steps["decode/cache_size"][[int(r["unit"]) for r in rows if r["policy"] == "h2o"
                                        and r["budget"] == "8"]] <= 8).all()
    meta = json.loads((out / "scenario.json").read_text())
    assert meta["variants"][0]["experiments"][0]["budgets"] == [8, 12]
    assert "numba" in meta["versions"]
    for fig in ("decode_mass_vs_budget", "decode_mass_over_time", "decode_recall_vs_budget"):
        assert (out / f"{fig}.png").stat().st_size > 5_000
    assert not (out / "decode_pareto.png").exists()  # it repeats recall_vs_budget
    assert not list(tmp_path.glob(".report.*"))


def test_existing_folders(scenario, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in ([], ["--force"]):  # a folder kvsim did not write is never replaced
        assert main([str(scenario), "--out", str(out), "--quiet", *force]) == 2
        err = capsys.readouterr().err
        assert "never replaces" in err and len(err.strip().splitlines()) == 1
        assert (out / "keep.txt").exists()
    report = tmp_path / "report"
    assert main([str(scenario), "--out", str(report), "--quiet"]) == 0
    capsys.readouterr()
    # The README's first command, repeated: a report of the same file is replaced, on stderr.
    assert main([str(scenario), "--out", str(report), "--quiet"]) == 0
    assert f"kvsim: replacing {report}, an earlier report of" in capsys.readouterr().err
    other = tmp_path / "other.toml"
    other.write_text(SMALL.replace('"small"', '"other"'))
    assert main([str(other), "--out", str(report), "--quiet"]) == 2
    assert "--force" in capsys.readouterr().err
    assert main([str(other), "--out", str(report), "--quiet", "--force"]) == 0
    assert json.loads((report / "scenario.json").read_text())["variants"][0]["name"] == "other"


def test_validate(scenario, capsys):
    assert main(["validate", str(scenario)]) == 0
    assert "ok" in capsys.readouterr().out


def test_policies_listing(capsys):
    assert main(["policies"]) == 0
    text = capsys.readouterr().out
    assert "recent_ratio" in text and "protect_window" in text


def test_policy_tables_are_the_registrys(capsys):
    """README.md and docs/policies.md show the table `kvsim policies --markdown` prints, as
    it prints it today: a policy added, or a rule changed, makes them stale."""
    assert main(["policies", "--markdown"]) == 0
    table = capsys.readouterr().out
    assert table.count("\n") == len(POLICIES) + 2 and "| `h2o` | heavy hitters |" in table
    for page in ("README.md", "docs/policies.md"):
        text = (ROOT / page).read_text()
        shown = text.split("<!-- policy table:", 1)[1].split("-->", 1)[1]
        shown = shown.split("<!-- end of policy table -->", 1)[0]
        assert shown.strip() == table.strip(), f"{page}: run python -m kvsim policies --markdown"


def test_bad_scenario_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text(SMALL.replace("sinks = 2", "sink = 2"))
    proc = subprocess.run([sys.executable, "-m", "kvsim", str(bad), "--out",
                           str(tmp_path / "r")], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"{bad}: policies.streaming_llm.sink: unknown key "
                                   f"(did you mean 'sinks'?); expected one of sinks")
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert not (tmp_path / "r").exists()


def test_help_teaches():
    proc = subprocess.run([sys.executable, "-m", "kvsim", "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0
    assert "validate" in proc.stdout and "examples" in proc.stdout


def test_cli_page_tables_every_run_option():
    """docs/cli.md's options table lists every option of a run, as the parser has them."""
    page = (ROOT / "docs" / "cli.md").read_text()
    table = page.split("## Options of a run", 1)[1].split("\n## ", 1)[0]
    rows = {row.split("|")[1].strip().strip("`").split()[0] for row in table.splitlines()
            if row.startswith("| `--")}
    options = {o for a in _run_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert rows == options - {"--help"}, f"docs/cli.md: table {sorted(rows)}, parser {sorted(options)}"
