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
from kvsim.policies import POLICIES
from kvsim.report import figures, plotting
from kvsim.report.stats import rolling_mean


def _lab(color: str) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour."""
    rgb = np.array(matplotlib.colors.to_rgb(color))
    linear = np.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722],
                    [0.0193, 0.1192, 0.9505]]) @ linear / np.array([0.95047, 1.0, 1.08883])
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787 * xyz + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def test_every_policy_has_a_fixed_colour_and_the_hues_are_distinct():
    assert set(POLICIES) <= set(plotting.POLICY_COLORS)
    n = len(plotting.POLICY_COLORS) + 2  # every policy's colour and the first two spares
    palette = [*plotting.POLICY_COLORS.values(), *plotting.SPARE_COLORS][:n]
    assert len(set(palette)) == n
    worst = min(np.linalg.norm(_lab(a) - _lab(b)) for a, b in itertools.combinations(palette, 2))
    assert worst >= 30, f"two of the {n} colours are only {worst:.1f} apart in CIELAB"
    for color in palette:  # no pastel: every line stands out on white
        assert _lab(color)[0] <= 80


def test_a_policy_keeps_its_colour_whatever_else_is_drawn():
    one = plotting.color_map(["tova", "h2o", "h2o_norm", "h2o_full"])
    two = plotting.color_map(["h2o_full", "scissorhands", "caote", "tova"])
    assert one["tova"] == two["tova"] == plotting.POLICY_COLORS["tova"]
    assert one["h2o"] == plotting.POLICY_COLORS["h2o"]
    assert len(set(one.values())) == 4  # labels that are not policy names take spares
    many = plotting.color_map([f"h2o[r={i}]" for i in range(20)])
    assert len(set(many.values())) == 20


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
