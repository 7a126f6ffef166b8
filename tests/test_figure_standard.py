"""The figure standard of docs/figures.md, where it can be checked: page width and panels a
row, one fixed and distinct colour per policy, 1 - mass on a log axis where masses crowd
near 1, one colour scale where panels compare, smoothing that invents nothing."""

from __future__ import annotations

import itertools
import struct

import matplotlib
import numpy as np
import pytest

import kvsim
from kvsim.policies import POLICIES, Policy, Presentation
from kvsim.report import figures, palette, plotting
from kvsim.report.stats import rolling_mean


_lab = palette.cielab
DECLARED = {name: p.presentation.color for name, p in POLICIES.items()}


def test_every_builtin_policy_declares_a_colour_and_the_hues_are_distinct():
    assert None not in DECLARED.values()
    assert all(p.presentation.marker in palette.MARKERS for p in POLICIES.values())
    n = len(DECLARED) + 2  # every policy's colour and the first two spares
    palette_ = [*DECLARED.values(), *plotting.SPARE_COLORS][:n]
    assert len(set(palette_)) == n
    worst = min(np.linalg.norm(_lab(a) - _lab(b)) for a, b in itertools.combinations(palette_, 2))
    assert worst >= palette.APART, f"two of the {n} colours are only {worst:.1f} apart in CIELAB"
    for color in palette_:  # no pastel: every line stands out on white
        assert _lab(color)[0] <= 80


def test_a_policy_keeps_its_colour_whatever_else_is_drawn():
    one = plotting.color_map(["tova", "h2o", "h2o_norm", "h2o_full"])
    two = plotting.color_map(["h2o_full", "scissorhands", "caote", "tova"])
    assert one["tova"] == two["tova"] == DECLARED["tova"]
    assert one["h2o"] == DECLARED["h2o"]
    assert len(set(one.values())) == 4  # labels that are not policy names take spares
    many = plotting.color_map([f"h2o[r={i}]" for i in range(20)])
    assert len(set(many.values())) == 20
    assert _worst_gap(many) >= palette.APART  # spares are spread as family colours are


FAMILIES = ("heavy hitters", "window vote", "recency", "new a", "new b", "new c", "new d")


@pytest.fixture
def forty_more(monkeypatch):
    """40 synthetic policies without a declared colour or marker, in three built-in
    families and four new ones, registered beside the built-in ones."""
    names = [f"synthetic_{i:02d}" for i in range(40)]
    for i, name in enumerate(names):
        policy = Policy(name, "synthetic", {}, run=lambda group, budget, params: None,
                        presentation=Presentation(family=FAMILIES[i % len(FAMILIES)]))
        monkeypatch.setitem(POLICIES, name, policy)
    return names


def _worst_gap(colors: dict[str, str]) -> float:
    return min(np.linalg.norm(_lab(a) - _lab(b))
               for a, b in itertools.combinations(colors.values(), 2))


def test_any_figure_of_many_registered_policies_draws_distinct_colours(forty_more):
    everyone = list(POLICIES)
    rng = np.random.default_rng(36)
    for size in [2, 3, 5, 8, 12, 16, 20, 24] * 12:
        figure = [str(name) for name in rng.choice(everyone, size, replace=False)]
        colors = plotting.color_map(figure)
        assert _worst_gap(colors) >= palette.APART, figure
        assert colors == plotting.color_map(figure)  # deterministic
        assert all(colors[name] == DECLARED[name] for name in figure if name in DECLARED)
        marks = palette.markers(figure)
        assert len(set(marks.values())) == min(size, len(palette.MARKERS))
    # every one of them at once: the colours stay apart as far as the colour space allows
    assert len(set(plotting.color_map(everyone).values())) == len(everyone)


def test_a_policy_without_a_colour_takes_a_shade_of_its_familys_hue(forty_more):
    def hue(color: str) -> float:
        _, a, b = _lab(color)
        return np.degrees(np.arctan2(b, a))

    h2o_kin = [n for i, n in enumerate(forty_more) if FAMILIES[i % len(FAMILIES)] == "heavy hitters"]
    alone = {n: palette.policy_color(n) for n in h2o_kin}
    assert len(set(alone.values())) == len(h2o_kin)  # a shade per member
    for name in h2o_kin[:len(palette.SHADES)]:  # the first shades keep the family's hue
        gap = abs(hue(alone[name]) - hue(DECLARED["h2o"]))
        assert min(gap, 360 - gap) < 15, (name, alone[name])
        assert plotting.color_map([name]) == {name: alone[name]}  # alone, drawn in it
    assert palette.policy_marker(h2o_kin[0]) in palette.MARKERS
    assert palette.policy_marker(h2o_kin[0]) == palette.markers([h2o_kin[0]])[h2o_kin[0]]


def test_a_figure_keeps_each_policys_marker_unless_an_earlier_label_has_it():
    marks = plotting.policy_markers(kvsim.load_scenario("scenarios/seed_notebook.toml").experiments[0])
    assert all(marks[name] == POLICIES[name].presentation.marker for name in marks
               if name in POLICIES)
    assert palette.markers(["caote", "full", "x"]) == {"caote": "o", "full": "s", "x": "D"}


def test_a_protocol_variant_takes_its_policys_colour_unless_it_shares_a_figure_with_it():
    toml_text = ('name = "p"\n[attention]\nsource = "field"\nT = 64\n'
                 '[policies.h2o]\n[policies.h2o_i16]\nkind = "h2o"\ninterval = 16\n'
                 '[policies.tova_t]\nkind = "tova"\nthreshold = 0.01\n'
                 '[[experiment]]\nname = "a"\nprompt_len = 32\nbudgets = [16]\n'
                 'policies = ["h2o", "tova_t"]\n'
                 '[[experiment]]\nname = "b"\nprompt_len = 32\nbudgets = [16]\n'
                 'policies = ["h2o_i16"]\n'
                 '[[experiment]]\nname = "c"\nprompt_len = 32\nbudgets = [16]\n'
                 'policies = ["h2o", "h2o_i16"]\n')
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "p.toml"
        path.write_text(toml_text)
        scenario = kvsim.load_scenario(path)
    colors = plotting.policy_colors(plotting.figure_context(scenario))
    assert colors["tova_t"] == DECLARED["tova"]  # the only tova anywhere
    assert colors["h2o"] == DECLARED["h2o"]
    assert colors["h2o_i16"] != colors["h2o"]  # experiment c draws both: a shade of h2o's
    assert colors["h2o_i16"] == plotting._shades(DECLARED["h2o"])[0]


def test_a_variants_shade_stays_apart_from_every_other_colour():
    shaded = 0
    for name in ("policy_zoo", "protocols", "h2o_online_vs_offline"):
        for scenario in kvsim.load_sweep(f"scenarios/{name}.toml"):
            ctx = plotting.figure_context(scenario)
            colors = plotting.policy_colors(ctx)
            kinds = {p.label: p.kind for e in ctx.experiments for p in e.policies}
            for label, color in colors.items():
                if label in DECLARED or \
                        color not in plotting._shades(DECLARED[kinds[label]]):
                    continue
                shaded += 1
                for other, c in colors.items():
                    if other != label:
                        gap = np.linalg.norm(_lab(color) - _lab(c))
                        assert gap >= plotting.SHADE_APART, (name, label, other, gap)
    assert shaded > 0  # the rule is exercised


def test_a_figure_names_its_layers():
    variants = kvsim.load_sweep("scenarios/real_smollm2.toml")  # one trace layer each
    assert [plotting.layers_note(plotting.figure_context(v)) for v in variants] == [
        "layer 0", "layer 15", "layer 29"]
    three = kvsim.load_scenario("scenarios/evict_or_quantize.toml")
    assert plotting.layers_note(plotting.figure_context(three)) == "layers 0, 15, 29"
    assert plotting.layers_note(plotting.figure_context(three), first_only=True) == "layer 0"
    field = kvsim.load_scenario("scenarios/seed_notebook.toml")
    assert plotting.layers_note(plotting.figure_context(field)) == ""


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 9, 14])
def test_panels_wrap_at_three_a_row_within_page_width(n):
    scenario = kvsim.load_scenario("scenarios/seed_notebook.toml")
    fig, axes, layout = plotting.grid(n, plotting.figure_context(scenario), max_cols=8)
    labels = [f"policy {i}" for i in range(n)]
    layout.finish(fig, "title", [matplotlib.lines.Line2D([], [])] * n, labels,
                  colorbar=None)
    assert layout.cols <= 3 and layout.rows * layout.cols >= n
    assert fig.get_size_inches()[0] * scenario.dpi <= plotting.MAX_WIDTH_PX + 1
    matplotlib.pyplot.close(fig)


def test_masses_crowding_near_one_go_on_a_log_loss_axis():
    assert figures._loss_scale([0.2, 0.5, 0.95])
    assert not figures._loss_scale([0.2, 0.5, 0.85, float("nan")])


def test_smoothing_leaves_gaps_and_never_extrapolates():
    x = np.array([np.nan, np.nan, 1.0, 2.0, np.nan, 4.0, 8.0])
    smooth = rolling_mean(x, 3)
    assert np.array_equal(np.isnan(smooth), np.isnan(x))
    assert np.allclose(smooth[~np.isnan(x)], [1.0, 1.5, 3.0, 6.0])
    assert np.nanmin(smooth) >= np.nanmin(x) and np.nanmax(smooth) <= np.nanmax(x)


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def test_report_figures_meet_the_standard(tmp_path):
    """A small report: every PNG within 1,200 px, mass figures on the loss axis when the
    masses crowd near 1, the field's key axis showing its first bin."""
    toml = tmp_path / "s.toml"
    toml.write_text('name = "s"\nseeds = [0, 1]\n[attention]\nsource = "field"\nT = 400\n'
                    'heads = 4\n[attention.sinks]\ncount = 4\nstrength = 12.0\n'
                    '[attention.recency]\nalpha = 1.5\n[policies.window]\n'
                    '[policies.streaming_llm]\n[policies.full]\n[[experiment]]\nname = "d"\n'
                    'prompt_len = 300\nbudgets = [16, 48]\n[output]\nformats = ["png"]\n')
    out = kvsim.run(toml, tmp_path / "report", workers=1)
    pngs = sorted(out.glob("*.png"))
    assert pngs
    for png in pngs:
        assert _png_size(png)[0] <= plotting.MAX_WIDTH_PX, png.name
    assert "d_mass_vs_budget.png" in (out / "report.md").read_text()
    fig = kvsim.load_report(out).plot("mass_vs_budget")  # window keeps ~0 of the sinks' mass
    panels = [ax for ax in fig.axes if ax.get_ylabel()]
    assert len(panels) == 4 and all(ax.get_yscale() == "log" for ax in panels)
    assert all(ax.get_ylabel().startswith("mass lost, 1 - mass") for ax in panels)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "not drawn: full (mass 1)" in legend
    fig.canvas.draw()
    ticks = [t.get_text() for ax in panels for t in ax.get_yticklabels(minor=True)
             + ax.get_yticklabels() if t.get_text()]
    assert ticks and all("$" not in t and len(t) <= 6 for t in ticks), ticks  # 0.34, 1e-4


def test_log_ticks_are_short_decimals():
    fig, ax = matplotlib.pyplot.subplots()
    ax.plot([0, 1], [0.22, 0.5])
    plotting.log_axis(ax)
    fig.canvas.draw()
    shown = [t.get_text() for t in ax.get_yticklabels(minor=True) if t.get_text()]
    assert {"0.3", "0.4"} <= set(shown)
    ax.set_ylim(1e-6, 1)
    fig.canvas.draw()
    shown = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert {"1e-6", "1e-5", "1e-4", "0.001", "0.01", "0.1", "1"} <= set(shown), shown
    matplotlib.pyplot.close(fig)


def test_threshold_runs_are_named_not_drawn_against_budget(tmp_path):
    """A threshold run has no budget (its rows repeat at every one): the against-budget
    figure names it instead of drawing a flat line."""
    toml = tmp_path / "t.toml"
    toml.write_text('name = "t"\n[attention]\nsource = "field"\nT = 96\nheads = 1\n'
                    '[policies.tova]\n[policies.tova_t]\nkind = "tova"\nthreshold = 0.01\n'
                    '[[experiment]]\nname = "d"\nprompt_len = 64\nbudgets = [16, 32]\n'
                    '[output]\nformats = ["png"]\n')
    out = kvsim.run(toml, tmp_path / "report", workers=1)
    fig = kvsim.load_report(out).plot("mass_vs_budget")
    drawn = {line.get_label() for ax in fig.axes for line in ax.get_lines()}
    assert "tova_t" not in drawn
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any(text.startswith("not drawn: tova_t (thresholds") for text in legend), legend
