"""Which figures a report draws: at most ``output.max_figures``, each after the question it
answers, none repeating another's data; layers never pooled head by head; headlines that
compare like with like (per-policy protocol signs, KIVI on output error, recall beside
mass)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import matplotlib.figure
import numpy as np
import pytest

import kvsim
from kvsim.errors import KvsimError
from kvsim.report import bytes_figure, figures, markdown, plotting, protocol_summary
from kvsim.scenario.overrides import Overrides

FIELD = """\
name = "choice"
seeds = [0, 1]
[attention]
source = "field"
T = 160
heads = 2
[attention.recency]
alpha = 0.8
[attention.heavy_hitters]
count = 6
strength = 4.0
[[attention.boost]]
keys = [40, 44]
queries = [140, 160]
strength = 8.0
[policies.h2o]
[policies.tova]
[policies.window]
[policies.full]
[[experiment]]
name = "decode"
prompt_len = 128
budgets = [16, 32, 64]
figures = ["mass_vs_budget", "recall_vs_budget", "pareto", "mass_over_time", "kept_raster"]
[[experiment]]
name = "again"
prompt_len = 128
budgets = [16, 32, 64]
[output]
formats = ["png"]
"""


def _scenario(tmp_path, text=FIELD):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return path


@pytest.fixture
def saved(monkeypatch):
    """The data of every figure saved, by file name (recorded as it is saved)."""
    data = {}
    original = matplotlib.figure.Figure.savefig

    def savefig(self, path, *args, **kwargs):
        data[str(path).rsplit("/", 1)[-1]] = plotting.figure_data(self)
        return original(self, path, *args, **kwargs)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    return data


def test_no_figure_of_a_report_repeats_another_figures_data(tmp_path, saved):
    """pareto repeats recall_vs_budget (every policy holds B keys), and the experiment
    `again` repeats `decode`: neither is drawn, and report.md says why."""
    out = kvsim.run(_scenario(tmp_path, FIELD.replace(
        "[output]", "[output]\nmax_figures = 40")), tmp_path / "r", workers=1)
    assert len(saved) >= 4
    names = sorted(saved)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not plotting.repeated(saved[b], {a: saved[a]}), (a, b)
            assert not plotting.repeated(saved[a], {b: saved[b]}), (a, b)
    text = (out / "report.md").read_text()
    assert "`decode_pareto` (= `decode_recall_vs_budget`)" in text
    assert "every policy of `again` gives the same results as in `decode`" in text


OTHER = FIELD.replace('name = "again"\nprompt_len = 128', 'name = "again"\nprompt_len = 112')


def test_a_report_draws_at_most_max_figures_each_after_its_purpose(tmp_path):
    out = kvsim.run(_scenario(tmp_path, OTHER), tmp_path / "r", workers=1)
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert len(pngs) == 6, pngs
    text = (out / "report.md").read_text()
    assert re.search(r"not drawn: `[a-z_]+`", text)
    for png in pngs:  # each image after the question it answers
        stem = png[:-4]
        assert re.search(rf"\*`{stem}`: [^\n]+\?[^\n]*\*\n\n!\[{stem}\]", text), stem
    # the comparison first: the budget figures are drawn, the field and column sums not
    assert "decode_mass_vs_budget.png" in pngs and "column_sums.png" not in pngs
    more = kvsim.run(_scenario(tmp_path, OTHER), tmp_path / "r2", workers=1,
                     overrides=Overrides(settings=[("output.max_figures", 9)]))
    assert len(list(more.glob("*.png"))) == 9


@pytest.mark.parametrize("value", [0, "six", 2.5])
def test_max_figures_is_validated(tmp_path, value):
    text = FIELD.replace("[output]", f"[output]\nmax_figures = {value!r}".replace("'", '"'))
    with pytest.raises(KvsimError, match=r"output\.max_figures: expected an integer in "
                                         r"\[1, 200\]"):
        kvsim.load_scenario(_scenario(tmp_path, text))


def _layer_rows():
    """Two layers x two heads, one policy at two budgets: head 0 of layer 0 and head 0 of
    layer 15 are unlike heads (masses 0.1 and 0.9)."""
    mass = {(0, 0): 0.1, (0, 1): 0.3, (15, 0): 0.9, (15, 1): 0.7}
    return [dict(policy="h2o", kind="h2o", budget=b, seed=0, layer=layer, head=head,
                 mass_mean=m + b / 1000, protocol="per_step")
            for (layer, head), m in mass.items() for b in (16, 32)]


def test_several_layers_draw_a_panel_per_layer_never_head_i_across_layers():
    scenario = kvsim.load_scenario("scenarios/evict_or_quantize.toml")
    ctx = plotting.figure_context(scenario)
    exp = scenario.experiments[0]
    rows = _layer_rows()
    exp = type(exp)(exp.name, exp.prompt_len, (16, 32), (16, 32),
                    tuple(p for p in exp.policies if p.label == "h2o"), None, 16, (16,))
    fig = figures.mass_vs_budget(ctx, exp, rows, None, {"h2o": "#d62728"},
                                 plotting.Target(None))[0]
    panels = {ax.get_title(): ax for ax in fig.axes if ax.get_title()}
    assert sorted(panels) == ["layer 0 (mean over its 9 heads)",
                              "layer 15 (mean over its 9 heads)"], sorted(panels)
    ys = {title: ax.get_lines()[0].get_ydata() for title, ax in panels.items()}
    # mass lost (layer 15 crowds near 1): each layer's own heads, never head 0 of both
    assert np.allclose(ys["layer 0 (mean over its 9 heads)"], [1 - 0.216, 1 - 0.232])
    assert np.allclose(ys["layer 15 (mean over its 9 heads)"], [1 - 0.816, 1 - 0.832])
    assert "layers 0, 15, 29" in fig._suptitle.get_text()
    matplotlib.pyplot.close(fig)


def test_the_protocol_headline_gives_each_policys_sign_never_their_mean():
    rows = []
    for kind, change in (("h2o", -0.013), ("tova", -0.012), ("snapkv", 0.053)):
        for head in range(3):
            for protocol, m in (("per_step", 0.8), ("interval=64", 0.8 + change)):
                rows.append(dict(kind=kind, protocol=protocol, peak_size=256, head=head,
                                 seed=0, mass_mean=m))
    text = "\n".join(protocol_summary.lines(rows))
    assert "costs attention mass in 2 of 3 (policy, protocol) pairs" in text
    assert "| `snapkv` | +0.053 (0 of 3 below 0" in text
    assert "| `h2o` | -0.013 (3 of 3 below 0" in text
    assert "+0.009" not in text  # the mean over policies, whose signs differ


def test_the_kivi_headline_compares_output_error_and_names_the_two_masses():
    scenario = kvsim.load_scenario("scenarios/evict_or_quantize.toml")
    rows = [dict(experiment="evict", policy="tova", budget=256, bytes_mean=65536.0,
                 mass_mean=0.7757, error_mean=0.166),
            dict(experiment="kivi2", policy="full", budget=256, bytes_mean=78950.0,
                 mass_mean=0.9204, error_mean=0.277)]
    text = "\n".join(bytes_figure.summary_lines(scenario, rows))
    assert "output error 0.277" in text and "has a lower one: 0.166" in text
    assert "exp(-KL)" in text and "not comparable" in text


def test_the_first_sentence_says_when_recall_ranks_the_policies_the_other_way(tmp_path):
    scenario = kvsim.load_scenario(_scenario(tmp_path))
    rows = [dict(experiment="decode", budget=32, policy=p, head=0, seed=0, mass_mean=m,
                 final_recall=r)
            for p, m, r in (("tova", 0.9, 0.0), ("h2o", 0.8, 1.0), ("window", 0.5, 0.0))]
    text = markdown._ranking(scenario, SimpleNamespace(rows=rows))
    assert "by final important-token recall: `h2o` 1.000 > `tova` 0.000 = `window` 0.000" \
        in text
    assert "disagree in 1 pair " in text
    assert "`tova` keeps more mass than `h2o` (0.900 against 0.800) but fewer of the " \
        "important tokens (0.000 against 1.000)" in text


def _closed_loop_rows(n: int = 40) -> list[dict]:
    """Runs whose layer-weighted mass and output error share one noise (the output error
    with a little more of its own), the other metrics noisier."""
    rng = np.random.default_rng(1)
    kl, shared = rng.random(n), rng.normal(0, 0.15, n)
    return [dict(kl=kl[i], mass_layer_weighted=-(kl[i] + shared[i]),
                 output_error=kl[i] + shared[i] + rng.normal(0, 0.08),
                 mass_mean=-(kl[i] + rng.normal(0, 0.1)), mass_min=-(kl[i] + rng.normal(0, 0.6)),
                 mass_p10=-(kl[i] + rng.normal(0, 0.6)),
                 neg_log_mass=kl[i] + rng.normal(0, 0.6)) for i in range(n)]


def test_the_closed_loop_headline_names_every_metric_a_paired_bootstrap_cannot_separate():
    from kvsim.tools.closed_loop import metrics
    from kvsim.tools.closed_loop.report import headline

    rows = _closed_loop_rows()
    ranks = metrics.rank_predictors(rows, "kl", 1000, 0)
    gaps = metrics.gaps_from_best(rows, ranks, 1000, 0)
    by = {g["predictor"]: g for g in gaps}
    # output error's interval overlaps the best's, but the paired difference is clear of 0
    assert by["output_error"]["ci_high"] > by["mass_mean"]["ci_low"]
    assert by["output_error"]["gap_low"] > 0 >= by["mass_layer_weighted"]["gap_low"]
    text = headline(gaps, 40, 0.8)
    assert text.startswith("Across 40 policy × budget runs, 2 of the 6 open-loop metrics "
                           "predict the model's own next-token KL about equally well")
    assert "**mean mass** ρ = 0.956 [0.895, 0.975]; **mass weighted by layer** ρ = 0.912" \
        in text
    assert "output error" not in text and "plain mean mass" not in text  # it leads
    for g in gaps[1:]:  # the paired difference, resample by resample, as its definition
        diff, lo, hi = metrics.paired_difference(
            metrics.PREDICTORS[gaps[0]["predictor"]] * np.array([r[gaps[0]["predictor"]]
                                                                 for r in rows]),
            metrics.PREDICTORS[g["predictor"]] * np.array([r[g["predictor"]] for r in rows]),
            np.array([r["kl"] for r in rows]), 1000, 0)
        assert diff == pytest.approx(gaps[0]["rho"] - g["rho"]) and lo <= diff <= hi


def test_the_closed_loop_names_a_single_best_only_clear_of_all_and_every_leader_else():
    from kvsim.tools.closed_loop.report import headline

    def gap(name, rho, lo, hi, gap_low):
        return dict(predictor=name, rho=rho, ci_low=lo, ci_high=hi, gap=0.01,
                    gap_low=gap_low, gap_high=0.05)
    four = [gap("neg_log_mass", 0.986, 0.955, 0.995, 0.0),
            gap("output_error", 0.986, 0.956, 0.994, -0.007),
            gap("mass_p10", 0.983, 0.948, 0.994, -0.005),
            gap("mass_mean", 0.981, 0.944, 0.991, 0.001),
            gap("mass_layer_weighted", 0.979, 0.939, 0.989, -0.001)]
    text = headline(four, 40, 0.86)
    assert "4 of the 5 open-loop metrics" in text and "..." not in text
    for name in ("KL of renormalised attention", "output error", "10th-percentile mass",
                 "mass weighted by layer"):
        assert f"**{name}" in text
    assert "plain mean mass has ρ = 0.981 [0.944, 0.991]" in text
    clear = [gap("mass_layer_weighted", 0.95, 0.93, 0.97, 0.0),
             gap("mass_mean", 0.6, 0.4, 0.7, 0.2)]
    text = headline(clear, 52, 0.83)
    assert "best predicts the model's own next-token KL is **mass weighted by layer**" in text
    assert "plain mean mass has ρ = 0.600 [0.400, 0.700]" in text


def test_under_kivi_the_mass_axis_says_exp_minus_kl_not_mass_lost():
    scenario = kvsim.load_scenario("scenarios/evict_or_quantize.toml")
    ctx = plotting.figure_context(scenario)
    kivi = next(e for e in scenario.experiments if e.quantize is not None)
    exp = type(kivi)(kivi.name, kivi.prompt_len, (16, 32), (16, 32),
                     tuple(p for p in kivi.policies if p.label == "h2o"), None, 16, (16,),
                     quantize=kivi.quantize)
    fig = figures.mass_vs_budget(ctx, exp, _layer_rows(), None, {"h2o": "#d62728"},
                                 plotting.Target(None))[0]
    labels = {ax.get_ylabel() for ax in fig.axes if ax.get_title()}
    assert labels == {"KIVI: 1 - exp(-KL), not mass lost (log)"}, labels
    matplotlib.pyplot.close(fig)
