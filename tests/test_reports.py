"""Reports: overrides, sweeps, parallel = serial, resume, report.md, figures and statistics."""

import csv
import json
import re

import numpy as np
import pytest

import kvsim
from kvsim.engine import experiments as engine
from kvsim.cli import main
from kvsim.errors import KvsimError
from kvsim.report.figures import FIGURES, Needs
from kvsim.report.plotting import Curves, draw_lines
from kvsim.report.stats import Estimate, estimate, rolling_mean, twins
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
    assert not units.exists()  # not started with resume: nothing kept
    calls.clear()
    with pytest.raises(KeyboardInterrupt) as interrupt:
        kvsim.run(path, out, workers=1, resume=True)
    assert not out.exists() and interrupt.value.kept_units == units
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


def png_width(path) -> int:
    return int.from_bytes(path.read_bytes()[16:20], "big")  # the PNG header's IHDR width


def test_report_markdown_and_figures(path, tmp_path):
    out = kvsim.run(path, tmp_path / "r", command="python -m kvsim study.toml")
    text = (out / "report.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "# study"
    # Opens with the ranking, computed from the results.
    assert lines[2].startswith("On the `field` source, the policies rank by attention mass kept "
                               "at B = 16 (experiment `decode`, mean over 2 heads and 2 seeds): ")
    rows = [r for r in read(out) if r["budget"] == "16"]
    means = {p: np.mean([float(r["mass_mean"]) for r in rows if r["policy"] == p])
             for p in ("h2o", "h2o_norm", "h2o_offline", "window")}
    best = max(means, key=means.get)
    assert lines[2].split(": ", 1)[1].startswith(f"`{best}` {means[best]:.3f}")
    assert "- command: `python -m kvsim study.toml`" in text and "- kvsim 0.1.0, " in text
    assert "wall time" in text and "Reading this report" in text
    # What a rerun changes (date, wall time, load) is in run.json, not in report.md.
    facts = json.loads((out / "run.json").read_text())
    assert facts["wall_time_s"] > 0 and facts["date"].endswith("UTC")
    assert facts["date"][:10] not in text
    # Per head, mean over seeds with an interval; the pooled column is labelled.
    assert "| policy | head 0, KV head 0 | head 1, KV head 0 | **mean over heads** |" in text
    assert "per head: mean over 2 seeds ± 95 % Student-t interval" in text
    assert "{" not in text and "1 query heads" not in text and "[0, 1]" not in text
    assert "#### Online versus offline H2O (B = 16)" in text
    assert "divided by the number of queries that saw the key" in text  # h2o_norm ran
    assert "full-attention scores" not in text  # no accumulate = "full" variant ran
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
        assert (out / image).stat().st_size > 5000, image
        assert png_width(out / image) <= 2000, image
    # At most six figures (output.max_figures), the comparison first; pareto only on request.
    for stem in ("field", "decode_kept_raster", "decode_h2o_online_vs_offline",
                 "decode_mass_over_time", "decode_mass_vs_budget", "decode_recall_vs_budget"):
        assert (out / f"{stem}.png").exists() and (out / f"{stem}.svg").exists(), stem
    assert len(list(out.glob("*.png"))) == 6 and not (out / "decode_pareto.png").exists()
    assert "not drawn: `decode_recall_over_time`, `column_sums`" in text
    assert not list(out.glob("*error*"))  # this source has no value vectors
    steps = np.load(out / "steps.npz")
    snaps = steps["decode/snapshots/h2o/seed0/kv0"]
    assert snaps.shape[1] == 16 and (snaps[:, :16] >= 0).all()  # full cache at every snapshot
    assert snaps.shape[0] == steps["decode/snap_steps"].shape[0]


def test_result_columns_name_their_policy(path, tmp_path):
    out = kvsim.run(path, tmp_path / "r", workers=1)
    rows = read(out)
    header = list(rows[0])
    assert "recent_ratio" not in header and "window" not in header
    assert {"h2o.recent_ratio", "h2o.normalize", "h2o_offline.recent_ratio"} <= set(header)
    assert not any(c.startswith(("snapkv.", "streaming_llm.")) for c in header)  # not run
    norm = next(r for r in rows if r["policy"] == "h2o_norm")
    window = next(r for r in rows if r["policy"] == "window")
    assert norm["h2o.normalize"] == "True" and norm["h2o_offline.recent_ratio"] == ""
    assert all(window[c] == "" for c in header if "." in c)


def test_one_seed_has_no_interval(path, tmp_path):
    path.write_text(SCENARIO.replace("seeds = [0, 1]", "seeds = [0]"))
    text = (kvsim.run(path, tmp_path / "r") / "report.md").read_text()
    assert "±" not in text and "one seed, so no interval" in text


QK = """name = "qk"
seeds = [0, 1]
[attention]
source = "field"
T = 64
heads = 2
kv_heads = 1
[attention.qk]
dim = 8
clusters = 3
values = true
[policies.window]
[policies.streaming_llm]
sinks = 0
[policies.tova]
[[experiment]]
name = "decode"
prompt_len = 24
budgets = [8, 16]
"""


def test_figures_follow_their_declared_needs(tmp_path):
    path = tmp_path / "qk.toml"
    path.write_text(QK)
    out = kvsim.run(path, tmp_path / "r")
    drawn = {p.stem for p in out.glob("*.png")}
    assert {"decode_error_vs_budget", "decode_error_over_time", "decode_mass_vs_budget"} <= drawn
    assert not drawn & {"decode_pareto", "decode_recall_vs_budget", "decode_recall_over_time"}
    text = (out / "report.md").read_text()
    assert "Relative output error at B = 16" in text and "can exceed 1" in text
    for fig in FIGURES.values():
        assert isinstance(fig.needs, Needs) and fig.draw.__name__ == fig.name


def test_requested_figures_are_checked(path, tmp_path):
    text = SCENARIO.replace('name = "decode"', 'name = "decode"\nfigures = ["heatmap"]')
    path.write_text(text)
    with pytest.raises(kvsim.ScenarioError, match=r"experiment\[0\].figures: expected a list of "):
        kvsim.run(path, tmp_path / "r")
    path.write_text(SCENARIO.replace("prompt_len = 32", 'prompt_len = 96\nfigures = ["mass_over_time"]'))
    with pytest.raises(kvsim.ScenarioError, match="'mass_over_time' needs decode steps"):
        kvsim.run(path, tmp_path / "r")
    path.write_text(QK.replace('budgets = [8, 16]', 'budgets = [8, 16]\nfigures = ["pareto"]'))
    assert main(["validate", str(path)]) == 2
    assert not (tmp_path / "r").exists()


def test_identical_curves_are_drawn_as_twins():
    import matplotlib.pyplot as plt
    curves = Curves()
    for panel, shift in ((0, 0.0), (1, 0.3)):
        curves.add(panel, "window", [1, 2], [0.1 + shift, 0.2])
        curves.add(panel, "streaming_llm", [1, 2], [0.1 + shift, 0.2])
        curves.add(panel, "h2o", [1, 2], [0.1 + shift, 0.205 + shift / 10])  # apart in panel 1
    fig, axes = plt.subplots(1, 2)
    colors = {"window": "C0", "streaming_llm": "C1", "h2o": "C2"}
    handles, labels = draw_lines(dict(enumerate(axes)), curves, colors,
                                 {p: "o" for p in colors})
    assert labels == ["window", "streaming_llm (= window)", "h2o (≈ window where dashed)"]
    assert handles[1].get_linestyle() != "-" and handles[0].get_linestyle() == "-"
    plt.close(fig)


def test_the_twin_tolerance_on_a_log_axis_grows_with_the_decades_shown():
    x = np.arange(50)
    curves = Curves()
    low = np.geomspace(0.01, 0.02, 50)
    for panel, top in ((0, 10.0), (1, 0.05)):  # panel 0 spans 3 decades, panel 1 under one
        curves.add(panel, "a", x, low)
        curves.add(panel, "b", x, low * 10 ** 0.02)  # 0.02 decades above a
        curves.add(panel, "c", x, np.full(50, top))
    found = curves.twins(log=True)
    assert found[0] == {"b": ("a", False)}  # 0.02 decades of 3: under 1 % of the panel
    assert found[1] == {}  # 0.02 decades of 0.7: apart on the page
    assert curves.twins(log=False) == {0: {"b": ("a", False)}, 1: {"b": ("a", False)}}


def test_stats_intervals_rounding_and_twins():
    from scipy import stats as scipy_stats
    values = [0.2, 0.25, 0.31]
    e = estimate(values)
    half = scipy_stats.t.ppf(0.975, 2) * np.std(values, ddof=1) / np.sqrt(3)
    assert e.mean == pytest.approx(np.mean(values)) and e.half_width == pytest.approx(half)
    assert e.text() == f"{np.mean(values):.2f} ± {half:.2f}"  # half-width 0.14: 2 decimals
    assert estimate([0.5]).text() == "0.500" and estimate([0.5]).half_width is None
    assert Estimate(0.27123, 0.0123, 4).text() == "0.271 ± 0.012"
    found = twins({"a": np.array([0.1, 0.2]), "b": np.array([0.1, 0.2]),
                   "c": np.array([0.1, 0.205]), "d": np.array([0.5, 0.2])})
    assert found == {"b": ("a", True), "c": ("a", False)}
    # a series over decoding: within the tolerance at 96 % of its steps, apart at 4 %
    series = np.linspace(0.2, 0.4, 100)
    spiky = series + np.where(np.arange(100) % 25 == 0, 0.05, 0.005)
    assert twins({"a": series, "b": spiky}) == {"b": ("a", False)}
    assert twins({"a": series, "b": series + np.where(np.arange(100) % 10 == 0, 0.05, 0)}) == {}
    assert twins({"a": series[:20], "b": spiky[:20]}) == {}  # few points: every one counts
    # the smoothing never invents a value: a NaN step (a gap) stays NaN
    assert np.allclose(rolling_mean(np.array([1.0, 3.0, 5.0, np.nan, 7.0]), 2),
                       [1, 2, 4, np.nan, 7], equal_nan=True)


def test_cold_cache_shows_a_compile_phase_without_eta(monkeypatch):
    from tqdm import tqdm
    monkeypatch.setattr(engine, "cache_is_warm", lambda: False)
    with tqdm(total=10, disable=False, file=open("/dev/null", "w")) as bar:
        assert engine._compile_phase(bar)
        assert bar.desc == engine.COMPILING and "remaining" not in bar.bar_format
        bar.update(4)
        engine._end_compile_phase(bar, "study")
        assert bar.desc == "study" and bar.bar_format is None
        assert bar.n == 4 and bar.initial == 4  # the rate counts only the units after it


def test_heads_can_be_named(path):
    named = SCENARIO.replace("[attention.recency]", '[[attention.head]]\nname = "local"\n'
                             '[[attention.head]]\nname = "heavy"\n[attention.recency]')
    path.write_text(named)
    from kvsim.report.plotting import figure_context, head_label
    s = kvsim.load_scenario(path)
    assert [head_label(figure_context(s), h) for h in (0, 1)] == [
        "head 0 (local), KV head 0", "head 1 (heavy), KV head 0"]
    path.write_text(named.replace('"heavy"', "3"))
    with pytest.raises(kvsim.ScenarioError, match=r"attention.head\[1\].name: expected a string"):
        kvsim.load_scenario(path)


def test_results_csv_floats_hold_12_significant_digits():
    """Sums whose last bits differ between CPUs write the same results.csv cell."""
    from kvsim.engine.records import csv_row
    a = 0.24612345678901234
    assert csv_row({"m": a})["m"] == csv_row({"m": a * (1 + 2e-15)})["m"] == "0.246123456789"
    assert csv_row({"m": 1.0, "n": float("nan"), "k": 3, "s": "h2o"}) == {
        "m": "1.0", "n": "nan", "k": 3, "s": "h2o"}
    assert float(csv_row({"m": 1e-300 / 3})["m"]) == pytest.approx(1e-300 / 3, rel=1e-11)


def test_the_overlap_panel_draws_each_kv_head_apart():
    """Online H2O can follow offline in one KV head and drift in another: the panel draws a
    line per KV head (up to four), never only their mean."""
    from types import SimpleNamespace

    import matplotlib.pyplot as plt

    from kvsim.report import h2o_study

    def panel(kv_heads: int):
        same, apart = np.array([[0, 1, 2]] * 4), np.array([[5, 6, 7]] * 4)
        snapshots = {}
        for kv in range(kv_heads):
            snapshots["h2o", 0, kv] = same
            snapshots["h2o_offline", 0, kv] = same if kv == 0 else apart
        steps = SimpleNamespace(snapshots=snapshots, snap_steps=np.arange(4))
        exp = SimpleNamespace(prompt_len=10, policies=[SimpleNamespace(kind="h2o", label="h2o")])
        ctx = SimpleNamespace(heads=kv_heads, kv_heads=kv_heads, head_names=())
        fig, ax = plt.subplots()
        h2o_study._overlap_panel(ctx, exp, steps, {"h2o": "C3"}, "h2o_offline", ax)
        drawn = [line.get_ydata() for line in ax.get_lines() if len(line.get_xdata())]
        plt.close(fig)
        return drawn, ax.get_title()

    drawn, title = panel(2)
    assert sorted(float(y[0]) for y in drawn) == [0.0, 1.0] and "per KV head" in title
    drawn, title = panel(5)  # past four: the mean, its range as a band
    assert [float(y[0]) for y in drawn] == [0.2] and "band: their range" in title
