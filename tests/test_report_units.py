"""What a report pools and where it draws: tables of several layers per layer (head i of one
layer and head i of another never pooled), each protocol's points at their policy's tick,
curves on one line named in their panel, log axes of at least a decade, the protocols a
report cannot compare at equal memory named, and the pyramid's per-policy caps explained."""

import csv

import matplotlib.pyplot as plt
import numpy as np
import pytest

import kvsim
from kvsim.report import markdown, protocol_summary
from kvsim.report.figures import PYRAMID_NOTE, allocation
from kvsim.report.plotting import (Curves, Target, at_least_a_decade, draw_lines,
                                   figure_context)

SCENARIO = ('[attention]\nsource = "field"\nT = 96\nheads = 4\nkv_heads = 2\nlayers = 3\n'
            "[attention.recency]\n[attention.noise]\n[attention.heavy_hitters]\ncount = 6\n"
            "[policies.tova]\n[policies.h2o]\n[output]\nformats = [\"png\"]\nmax_figures = 1\n"
            '[[experiment]]\nname = "uniform"\nprompt_len = 64\nbudgets = [12, 20]\n'
            '[[experiment]]\nname = "pyramid"\nprompt_len = 64\nbudgets = [12, 20]\n'
            'allocation = "pyramid"\nbeta = 2\n')


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layers")
    (folder / "s.toml").write_text(SCENARIO)
    out = kvsim.run(folder / "s.toml", folder / "r", workers=1)
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    for r in rows:
        for key in ("budget", "layer", "head", "kv_head", "b_h", "seed", "peak_size"):
            r[key] = int(r[key])
        r["mass_mean"] = float(r["mass_mean"])
    return kvsim.load_scenario(folder / "s.toml"), out, rows


def _cells(lines: list[str], title: str) -> list[list[str]]:
    """The rows of the table under the first line starting with ``title``."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    table = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        table.append([c.strip() for c in line.strip("|").split("|")])
    return table


def test_tables_of_several_layers_hold_a_column_per_layer_never_head_i_of_all(layered):
    scenario, out, rows = layered
    lines = (out / "report.md").read_text().splitlines()
    table = _cells(lines, "**Attention mass kept at B = 20, per layer")
    assert table[0] == ["policy", "layer 0", "layer 1", "layer 2", "**mean over layers**"]
    assert not any(line.startswith("| policy | head 0") for line in lines)
    for row in table[2:]:
        label = row[0].strip("`")
        for layer in range(3):  # the layer's column: the mean over its four heads
            mine = [r["mass_mean"] for r in rows if r["experiment"] == "uniform"
                    and r["policy"] == label and r["budget"] == 20 and r["layer"] == layer]
            assert len(mine) == 4 and row[1 + layer] == f"{np.mean(mine):.3f}"
    low = _cells(lines, "**Lowest attention mass at any decode step, of any of the layer's")
    assert low[0] == ["policy", "layer 0", "layer 1", "layer 2"]
    assert "Tables are per layer" in "\n".join(lines)
    assert "mean over 4 heads x 3 layers" in "\n".join(lines)  # the ranking says what it pools


def test_a_table_of_many_units_turns_to_a_row_per_unit():
    units = [f"layer {i}" for i in range(12)]
    cells = [[str(i) for i in range(12)] + ["m"], [str(-i) for i in range(12)] + ["n"]]
    table = markdown._unit_table(units, ["a", "b"], cells, "**mean over layers**")
    assert table[0] == "|  | `a` | `b` |"
    assert table[2] == "| layer 0 | 0 | 0 |" and table[13] == "| layer 11 | 11 | -11 |"
    assert table[14] == "| **mean over layers** | m | n |"


def _row(kind, policy, protocol, peak, mass, head=0, seed=0):
    return {"kind": kind, "policy": policy, "protocol": protocol, "peak_size": peak,
            "mean_size": float(peak), "mass_mean": mass, "head": head, "seed": seed}


def test_each_policys_protocol_points_sit_at_its_own_tick():
    rows = [_row(k, k, "per_step", 64, 0.9, h) for k in ("h2o", "snapkv", "tova")
            for h in range(5)]
    rows += [_row(k, f"{k}_i", "interval=16", 64, 0.9 + d * (h - 2), h)
             for k, d in (("h2o", 0.01), ("snapkv", -0.02), ("tova", 0.005)) for h in range(5)]
    rows += [_row("tova", "tova_q", "before_question", 64, 0.8, h) for h in range(5)]
    scenario = kvsim.load_scenario("scenarios/seed_notebook.toml")
    (fig,) = protocol_summary.figure(figure_context(scenario), rows, Target(None))
    assert len(fig.axes) == 2  # a panel per protocol
    for ax in fig.axes:
        names = [t.get_text() for t in ax.get_xticklabels()]
        for line in ax.get_lines()[:-1]:  # the last: the zero line
            x = np.asarray(line.get_xdata(), float)
            tick = int(round(float(np.mean(x))))
            assert np.all(np.abs(x - tick) <= protocol_summary.SPREAD + 1e-12)
            assert line.get_color() is not None and 0 <= tick < len(names)
        assert names == (["h2o", "snapkv", "tova"] if len(names) == 3 else ["tova"])
    plt.close(fig)


def test_protocols_without_a_per_step_run_at_their_peak_are_named():
    rows = [_row("h2o", "h2o", "per_step", 64, 0.9), _row("h2o", "h2o_i", "interval=16", 64, 0.8),
            _row("h2o", "h2o_r", "target_ratio=0.1/interval=16", 71, 0.85),
            _row("h2o", "h2o_t", "threshold=1/window=8", 90, 0.95)]
    assert protocol_summary.unmatched(rows) == {"target_ratio=0.1/interval=16": [71]}
    text = "\n".join(protocol_summary.lines(rows))
    assert "`target_ratio=0.1/interval=16` (peak 71)" in text and "threshold" not in text


def test_curves_on_one_line_are_named_in_their_panel():
    curves = Curves()
    x = [64, 128, 256]
    for name in ("window", "h2o", "tova", "snapkv"):
        curves.add(0, name, x, [0.99, 0.99, 0.99])
    curves.add(0, "oracle", x, [0.1, 0.05, 0.02])
    curves.add(1, "window", x, [0.5, 0.4, 0.3])
    curves.add(1, "h2o", x, [0.5, 0.4, 0.3])  # two on one line: the dashes say it
    fig, axes = plt.subplots(1, 2)
    colors = dict.fromkeys(["window", "h2o", "tova", "snapkv", "oracle"], "black")
    draw_lines(dict(enumerate(axes)), curves, colors, dict.fromkeys(colors, "o"), log=True)
    notes = [t.get_text().replace("\n", " ") for t in axes[0].get_legend().get_texts()]
    assert notes == ["on one line: window, h2o, tova, snapkv"]
    assert axes[1].get_legend() is None
    plt.close(fig)


def test_a_log_axis_spans_at_least_a_decade_and_stays_under_its_bound():
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0.596, 0.608])
    ax.set_yscale("log")
    at_least_a_decade(ax, top=1.0)
    low, high = ax.get_ylim()
    assert high == pytest.approx(1.0) and low == pytest.approx(0.1)
    ax.set_ylim(0.01, 0.5)  # already wider: left alone
    at_least_a_decade(ax, top=1.0)
    assert ax.get_ylim() == pytest.approx((0.01, 0.5))
    plt.close(fig)


def test_the_pyramid_figure_says_why_its_caps_differ_by_policy(layered):
    scenario, _, rows = layered
    ctx = figure_context(scenario)
    for exp in scenario.experiments:
        mine = [r for r in rows if r["experiment"] == exp.name]
        (fig,) = allocation(ctx, exp, mine, None, {}, Target(None))
        assert (PYRAMID_NOTE in fig._suptitle.get_text()) == (exp.allocation == "pyramid")
        plt.close(fig)


def test_heads_with_the_same_components_say_what_tells_them_apart():
    lines = markdown._what_was_run(kvsim.load_scenario("scenarios/h2o_online_vs_offline.toml"))
    assert "  - head 0: sinks, recency, heavy_hitters, noise (recency.alpha = 0.6)" in lines
    assert "  - head 1: sinks, recency, heavy_hitters, noise (recency.alpha = 1.2)" in lines


def test_the_headline_says_where_output_error_ranks_the_policies_otherwise():
    scenario = kvsim.load_sweep("scenarios/real_smollm2.toml")[0]  # layer 0
    exp = scenario.experiments[0]
    with open("reports/real_smollm2/results.csv") as f:
        rows = [r for r in csv.DictReader(f) if r["variant"] == "attention.layer=0"
                and int(r["budget"]) == exp.focus_budget]
    for r in rows:
        r["mass_mean"], r["error_mean"] = float(r["mass_mean"]), float(r["error_mean"])
    order, means = markdown._order(rows, exp, "mass_mean")
    text = markdown._error_disagreement(rows, exp, order, means)
    assert "`full` 0.000 < `window` 0.196 <" in text
    assert "`oracle` keeps more mass than `window` (0.570 against 0.485) but its output error " \
           "is larger (0.355 against 0.196)" in text
    same = {p: i for i, p in enumerate(order)}  # errors in the order of mass: nothing to say
    assert markdown._error_disagreement(
        [dict(r, error_mean=float(same[r["policy"]] + 1)) for r in rows], exp, order,
        means) == ""


def test_an_allocation_headline_of_one_seed_says_it_is_not_replicated(layered):
    scenario, out, _ = layered
    assert scenario.seeds == (0,) or list(scenario.seeds) == [0]
    line = (out / "report.md").read_text().splitlines()[2]
    assert line.startswith("At equal memory") and "One seed, so no interval" in line


def test_a_budget_below_the_peak_says_the_peak():
    from kvsim.report.figures import peak_note

    rows = [{"budget": 193, "peak_size": 256, "kind": "h2o", "protocol": "interval=64"},
            {"budget": 193, "peak_size": 256, "kind": "tova", "protocol": "interval=64"},
            {"budget": 193, "peak_size": 2048, "kind": "full", "protocol": "per_step"}]
    assert peak_note(rows, 193) == " (peak 256)"
    rows.append({"budget": 193, "peak_size": 271, "kind": "h2o", "protocol": "target_ratio"})
    assert peak_note(rows, 193) == " (peak 256 to 271)"
    assert peak_note([{"budget": 64, "peak_size": 64, "kind": "h2o", "protocol": "per_step"}],
                     64) == ""
