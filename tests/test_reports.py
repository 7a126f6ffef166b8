"""Reports: overrides, sweeps, parallel = serial, resume after an interruption, report.md."""

import csv
import re

import numpy as np
import pytest

import kvsim
from kvsim.engine import experiments as engine
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.scenario.overrides import Overrides, parse_budgets, parse_seeds, parse_setting

SCENARIO = """\
name = "study"
seeds = [0, 1]

[attention]
source = "field"
T = 96
heads = 2
kv_heads = 1

[attention.recency]
alpha = 0.8
[attention.heavy_hitters]
count = 6
strength = 4.0
[attention.noise]
scale = 0.5

[policies.h2o]
[policies.h2o_norm]
kind = "h2o"
normalize = true
[policies.h2o_offline]
[policies.window]

[[experiment]]
name = "decode"
prompt_len = 32
budgets = [8, 16, 24]

[output]
formats = ["png", "svg"]
"""


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "study.toml"
    p.write_text(SCENARIO)
    return p


def read(out):
    return list(csv.DictReader(open(out / "results.csv")))


def test_parsers():
    assert parse_budgets("64,128,0.5") == [64, 128, 0.5]
    assert parse_seeds("0:4") == [0, 1, 2, 3] and parse_seeds("1,5") == [1, 5]
    assert parse_setting("attention.noise.scale=0.3") == ("attention.noise.scale", 0.3)
    assert parse_setting('attention.noise.kind="gumbel"') == ("attention.noise.kind", "gumbel")
    for bad in (lambda: parse_budgets("1,,2"), lambda: parse_seeds("4:2"),
                lambda: parse_setting("novalue")):
        with pytest.raises(KvsimError):
            bad()


def test_overrides_are_validated_like_the_file(path):
    (s,) = kvsim.load_sweep(path, Overrides(budgets=[4, 0.5], seeds=[3], policies=["h2o", "oracle"],
                                            settings=[("attention.noise.scale", 0.25)]))
    exp = s.experiments[0]
    assert exp.budgets == (4, 16) and s.seeds == (3,)
    assert [p.label for p in exp.policies] == ["h2o", "oracle"]
    assert s.attention["per_head"][0]["noise"]["scale"] == 0.25
    with pytest.raises(kvsim.ScenarioError, match=r"attention.noise.scale: expected a number in \[0, 10000\]"):
        kvsim.load_sweep(path, Overrides(settings=[("attention.noise.scale", -1.0)]))


def test_sweep_expands_policies_and_field_variants(path, tmp_path):
    path.write_text(SCENARIO + '[sweep]\n"policies.h2o.recent_ratio" = [0.25, 0.75]\n'
                               '"attention.heavy_hitters.exponent" = [0.5, 1.5]\nseeds = [4]\n')
    variants = kvsim.load_sweep(path)
    assert [v.variant for v in variants] == [{"attention.heavy_hitters.exponent": 0.5},
                                             {"attention.heavy_hitters.exponent": 1.5}]
    labels = [p.label for p in variants[0].experiments[0].policies]
    assert labels == ["h2o[recent_ratio=0.25]", "h2o[recent_ratio=0.75]", "h2o_norm",
                      "h2o_offline", "window"]
    assert variants[0].experiments[0].policies[1].params["recent_ratio"] == 0.75
    assert variants[0].seeds == (4,)
    out = kvsim.run(variants, tmp_path / "r")
    rows = read(out)
    assert {r["variant"] for r in rows} == {"attention.heavy_hitters.exponent=0.5",
                                            "attention.heavy_hitters.exponent=1.5"}
    assert len(rows) == 2 * len(labels) * 3 * 2  # variants x policies x budgets x heads
    steps = np.load(out / "steps.npz")
    assert "v1/decode/mass" in steps.files
    assert (out / "v1_decode_mass_vs_budget.png").exists()
    with pytest.raises(kvsim.ScenarioError, match="use load_sweep"):
        kvsim.load_scenario(path)


def test_workers_do_not_change_results(path, tmp_path):
    one = kvsim.run(path, tmp_path / "one", workers=1)
    two = kvsim.run(path, tmp_path / "two", workers=2)
    assert (one / "results.csv").read_bytes() == (two / "results.csv").read_bytes()
    a, b = np.load(one / "steps.npz"), np.load(two / "steps.npz")
    assert a.files == b.files and all(np.array_equal(a[k], b[k], equal_nan=True) for k in a.files)


def test_interrupted_run_resumes(path, tmp_path, monkeypatch):
    clean = kvsim.run(path, tmp_path / "clean")
    real = engine.run_budgets
    calls = []

    def interrupt_after_three(*args, **kwargs):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "run_budgets", interrupt_after_three)
    out = tmp_path / "report"
    with pytest.raises(KeyboardInterrupt):
        kvsim.run(path, out, workers=1)
    assert not out.exists()  # no half-written report
    units = tmp_path / ".report.units"
    assert len(list(units.glob("*.npz"))) == 3

    resumed = []
    monkeypatch.setattr(engine, "run_budgets",
                        lambda *a, **k: resumed.append(1) or real(*a, **k))
    kvsim.run(path, out, workers=1, resume=True)
    total = 4 * 2  # policies x seeds (one KV head)
    assert len(resumed) == total - 3
    assert (out / "results.csv").read_bytes() == (clean / "results.csv").read_bytes()
    assert not units.exists()


def test_cli_interrupt_exits_130_without_report(path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(engine, "run_budgets", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    assert main([str(path), "--out", str(tmp_path / "r"), "--quiet"]) == 130
    assert "interrupted" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_report_markdown_and_figures(path, tmp_path):
    out = kvsim.run(path, tmp_path / "r")
    text = (out / "report.md").read_text()
    assert text.startswith("# study")
    assert "| `h2o` |" in text and "B = 16" in text
    assert "Online versus offline H2O (budget 16)" in text
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (out / image).stat().st_size > 5000, image
    for stem in ("field", "decode_kept_raster", "decode_h2o_online_vs_offline",
                 "decode_mass_over_time", "decode_mass_vs_budget", "decode_recall_vs_budget"):
        assert (out / f"{stem}.png").exists() and (out / f"{stem}.svg").exists(), stem
    steps = np.load(out / "steps.npz")
    snaps = steps["decode/snapshots/h2o/seed0/kv0"]
    assert snaps.shape[1] == 16 and (snaps[:, :16] >= 0).all()  # full cache at every snapshot
    assert snaps.shape[0] == steps["decode/snap_steps"].shape[0]
