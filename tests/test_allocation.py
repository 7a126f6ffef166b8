"""Budget allocation (uniform, ada, pyramid): plain references for both rules, checked
against the engine's per-head caps and kept sets; caps enforced; fields with layers; the
on-demand trace cache."""

from __future__ import annotations

import numpy as np
import pytest
from allocation_checks import (ada_reference, dense_scenario, pyramid_reference,
                               random_attention, selectable_scores)
from fake_capture import fake_model, use_fake_capture

import reference as ref
from kvsim.engine import allocation
from kvsim.engine.experiments import simulate_scenario
from kvsim.errors import InvariantError, KvsimError, ScenarioError
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params, run_capped
from kvsim.scenario.load import load_scenario

# ---------------------------------------------------------------- plain references


def reference_run(policy: str, p: np.ndarray, P: int, cap: int, B: int, params: dict):
    """The reference policy at capacity ``cap`` with the fixed parts of ``B``; the final cache."""
    T = p.shape[0]
    if policy == "h2o":
        prefill, steps = ref.policy_h2o(p, P, T, cap, params["recent_ratio"], False, "observed",
                                        recent=int(params["recent_ratio"] * B))
    elif policy == "snapkv":
        prefill, steps = ref.policy_snapkv(p, P, T, cap, params["window"], params["kernel"],
                                           params["pooling"], True)
    else:
        prefill, steps = ref.policy_tova(p, P, T, cap)
    return sorted(steps[-1] if steps else prefill), [len(c) for c in steps]


# ---------------------------------------------------------------- the rules alone


@pytest.mark.parametrize("seed", range(40))
def test_ada_caps_match_the_reference(seed):
    rng = np.random.default_rng(seed)
    H, n = rng.integers(1, 5), rng.integers(1, 30)
    B = int(rng.integers(1, n + 8))
    fixed = int(rng.integers(0, B))
    share = float(rng.choice([0.0, 0.2, 0.5, 1.0, rng.random()]))
    # Coarse scores make ties across heads and within a head common.
    scores = [rng.integers(0, 4, size=n).astype(float) for _ in range(H)]
    got = allocation.ada_caps(scores, B, fixed, share)
    assert got.tolist() == ada_reference([s.tolist() for s in scores], B, fixed, share)
    assert got.sum() == H * B


@pytest.mark.parametrize("B", [1, 2, 7, 64, 100, 512])
@pytest.mark.parametrize("L", [2, 3, 7, 30])
def test_pyramid_budgets_match_the_reference(B, L):
    for fixed in sorted({0, min(1, B - 1), B // 2, B - 1}):  # fixed < B, as budgets ensure
        for beta in (1.0, 2.0, 7.5, 20.0):
            got = allocation.pyramid_budgets(B, fixed, beta, L, T=512)
            assert got.tolist() == pyramid_reference(B, fixed, beta, L, T=512)
            assert got.sum() == L * B and got.min() >= fixed + 1
            assert (np.diff(got) <= 1).all()  # falls with depth (the remainder adds at most 1)


def test_check_total_raises():
    with pytest.raises(InvariantError, match="layer total 12"):
        allocation.check_total(np.array([5, 6]), 12, "x")


# ---------------------------------------------------------------- engine against the reference


@pytest.mark.parametrize("case", range(6))
def test_ada_caps_and_kept_sets_match_the_reference(tmp_path, case):
    rng = np.random.default_rng(100 + case)
    H, T = 3, int(rng.integers(50, 80))
    P = T if case % 3 == 0 else int(rng.integers(T // 2, T - 2))
    attention = random_attention(rng, H, T)
    share = [0.2, 0.25, 0.5][case % 3]
    policies = ('[policies.h2o]\n[policies.snapkv]\nwindow = 4\nkernel = 3\n[policies.tova]\n')
    budgets = [14, 24]
    scenario = load_scenario(dense_scenario(tmp_path, attention, P, budgets, policies,
                                             f'allocation = "ada"\nfloor_share = {share}'))
    results = simulate_scenario(scenario, progress=False, workers=1)
    kept = results.steps[scenario.experiments[0].name].arrays()["kept"]
    p = [ref.normalise_rows(a) for a in attention]
    for config in scenario.experiments[0].policies:
        for B in budgets:
            fixed, scores = zip(*(selectable_scores(config.kind, p[h], P, B, config.params)
                                  for h in range(H)))
            caps = ada_reference(list(scores), B, fixed[0], share)
            rows = sorted((r for r in results.rows if r["policy"] == config.label
                           and r["budget"] == B), key=lambda r: r["kv_head"])
            assert [r["b_h"] for r in rows] == caps, (config.label, B)
            for r, cap in zip(rows, caps):
                want, sizes = reference_run(config.kind, p[r["kv_head"]], P, cap, B,
                                            config.params)
                got = kept[r["unit"]]
                assert got[got >= 0].tolist() == want, (config.label, B, r["kv_head"])
                assert max(sizes, default=0) <= cap


def test_pyramid_caps_and_kept_sets_on_a_field_with_layers(tmp_path):
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "field"\nT = 96\nheads = 4\nkv_heads = 2\nlayers = 4\n'
        "[attention.recency]\n[attention.noise]\n[attention.sinks]\n"
        "[policies.tova]\n[policies.streaming_llm]\nsinks = 2\n[policies.full]\n"
        '[[experiment]]\nname = "u"\nprompt_len = 64\nbudgets = [8, 20]\n'
        '[[experiment]]\nname = "p"\nprompt_len = 64\nbudgets = [8, 20]\n'
        'allocation = "pyramid"\nbeta = 3\n')
    scenario = load_scenario(tmp_path / "s.toml")
    assert scenario.layers == (0, 1, 2, 3)
    results = simulate_scenario(scenario, progress=False, workers=1)
    kept = results.steps["p"].arrays()["kept"]
    for r in results.rows:
        fixed = {"tova": 0, "streaming_llm": 2, "full": None}[r["kind"]]
        if r["experiment"] == "u" or fixed is None:
            assert r["b_h"] == r["budget"]
            continue
        cap = pyramid_reference(r["budget"], fixed, 3.0, 4, 96)[r["layer"]]
        assert r["b_h"] == cap
        # The run at the cap is the policy at budget cap on that layer's field.
        field = scenario.field(r["seed"], r["layer"]).data
        group = make_group(field, r["kv_head"], 64, np.zeros((4, 96), bool), {})
        policy = POLICIES[r["kind"]]
        params = resolve_params(policy, {"sinks": 2} if r["kind"] == "streaming_llm" else {})
        want = policy.run(group, cap, params).kept
        got = kept[r["unit"]]
        assert got[got >= 0].tolist() == want.tolist()


def test_uniform_is_todays_run_and_layer_zero_todays_field(tmp_path):
    base = ('[attention]\nsource = "field"\nT = 80\nheads = 2\n{layers}'
            "[attention.heavy_hitters]\ncount = 5\n[attention.noise]\n"
            "[attention.qk]\ndim = 8\n"
            "[policies.h2o]\n[policies.random]\n"
            "[[experiment]]\nprompt_len = 50\nbudgets = [10]\n")
    (tmp_path / "one.toml").write_text(base.format(layers=""))
    (tmp_path / "two.toml").write_text(base.format(layers="layers = 2\n"))
    one, two = (simulate_scenario(load_scenario(tmp_path / f), progress=False, workers=1)
                for f in ("one.toml", "two.toml"))
    first = [r for r in two.rows if r["layer"] == 0]
    assert len(first) == len(one.rows) and len(two.rows) == 2 * len(one.rows)
    for a, b in zip(one.rows, first):
        assert a["mass_mean"] == b["mass_mean"] and a["b_h"] == b["b_h"] == 10
    second = [r for r in two.rows if r["layer"] == 1]
    assert [r["mass_mean"] for r in second] != [r["mass_mean"] for r in first]


def test_a_cap_is_enforced_at_every_step(tmp_path):
    rng = np.random.default_rng(0)
    field = random_attention(rng, 1, 30)
    from kvsim.numerics.field import dense_field
    group = make_group(dense_field(field), 0, 20, np.zeros((1, 30), bool), {})
    tova = POLICIES["tova"]
    assert run_capped(tova, group, 6, 8, {}).cache_size.max() == 6
    import dataclasses
    greedy = dataclasses.replace(tova, run_capped=lambda g, cap, b, p: tova.run(g, cap + 1, p))
    with pytest.raises(InvariantError, match="limit of 6"):
        run_capped(greedy, group, 6, 8, {})


@pytest.mark.parametrize("body, key, message", [
    ('allocation = "pyramid"', "experiment[0].allocation", "several layers"),
    ('allocation = "ada"\n[policies.window]', "experiment[0].allocation", "prefill score"),
    ('floor_share = 0.3', "experiment[0].floor_share", "only with allocation = 'ada'"),
    ('allocation = "ada"\nfloor_share = 0.01', "experiment[0].floor_share", ">= 1"),
    ('allocation = "evenly"', "experiment[0].allocation", "expected one of"),
])
def test_allocation_errors_name_the_key(tmp_path, body, key, message):
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "field"\nT = 64\n[policies.tova]\n'
        f"[[experiment]]\nprompt_len = 32\nbudgets = [8]\n{body}\n")
    with pytest.raises(ScenarioError) as info:
        load_scenario(tmp_path / "s.toml")
    assert any(k == key and message in m for _, k, m in info.value.problems), info.value


# ---------------------------------------------------------------- on-demand traces


def test_on_demand_trace_is_captured_once_and_cached(tmp_path, monkeypatch):
    calls: list = []
    use_fake_capture(monkeypatch, calls)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fake_model(tmp_path / "model")
    (tmp_path / "text.txt").write_text("some text")

    def scenario(tokens: int, text: str = "text.txt"):
        (tmp_path / "s.toml").write_text(
            f'[attention]\nsource = "trace"\nmodel = "model"\ntext = "{text}"\n'
            f'tokens = {tokens}\nlayers = "all"\n[policies.tova]\n'
            "[[experiment]]\nprompt_len = 20\nbudgets = [8]\nallocation = \"pyramid\"\n")
        return load_scenario(tmp_path / "s.toml")

    s = scenario(32)
    assert s.layers == (0, 1) and s.T == 32 and len(calls) == 1
    cached = list((tmp_path / "cache" / "kvsim" / "traces").glob("*.npz"))
    assert len(cached) == 1
    scenario(32)
    assert len(calls) == 1  # reused
    rows = simulate_scenario(s, progress=False, workers=1).rows
    assert sorted({r["layer"] for r in rows}) == [0, 1]
    scenario(40)
    (tmp_path / "other.txt").write_text("other text")
    scenario(32, "other.txt")
    assert len(calls) == 3 and len(list(cached[0].parent.glob("*.npz"))) == 3


def test_on_demand_trace_without_the_extra_names_it(tmp_path, monkeypatch, without_torch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    fake_model(tmp_path / "model")
    (tmp_path / "text.txt").write_text("some text")
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "trace"\nmodel = "model"\ntext = "text.txt"\ntokens = 8\n'
        "[policies.tova]\n[[experiment]]\nbudgets = [4]\n")
    from kvsim.cli import main
    assert main(["validate", str(tmp_path / "s.toml")]) == 2
    with pytest.raises(KvsimError, match=r'pip install -e "\.\[capture\]"'):
        load_scenario(tmp_path / "s.toml")


def test_report_opens_with_the_comparison_and_draws_the_allocation_figure(tmp_path):
    import csv

    import kvsim
    from kvsim.report.figures import allocation_grids
    body = ('[attention]\nsource = "field"\nT = 96\nheads = 4\nkv_heads = 2\nlayers = 3\n'
            "[attention.recency]\n[attention.noise]\n[attention.heavy_hitters]\ncount = 6\n"
            "[policies.tova]\n[policies.h2o]\n[output]\nformats = [\"png\"]\n")
    for name, extra in (("uniform", ""), ("ada", 'allocation = "ada"'),
                        ("pyramid", 'allocation = "pyramid"\nbeta = 2')):
        body += f'[[experiment]]\nname = "{name}"\nprompt_len = 64\nbudgets = [12, 20]\n{extra}\n'
    (tmp_path / "s.toml").write_text(body)
    out = kvsim.run(tmp_path / "s.toml", tmp_path / "r", workers=1)
    lines = (out / "report.md").read_text().splitlines()
    assert lines[2].startswith("At equal memory") and "AdaKV keeps more than uniform in" in lines[2]
    assert "PyramidKV keeps more than uniform in" in lines[2]
    assert {"ada_allocation.png", "pyramid_allocation.png"} <= {p.name for p in out.iterdir()}
    assert "uniform_allocation.png" not in {p.name for p in out.iterdir()}  # not by default
    # The allocations compared at equal memory, under the opening sentence and table.
    assert "![allocation_vs_uniform](allocation_vs_uniform.png)" in lines
    assert (out / "allocation_vs_uniform.png").stat().st_size > 10_000
    with open(out / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"allocation", "b_h", "layer"} <= set(rows[0])
    ada = [dict(r, b_h=int(r["b_h"]), budget=int(r["budget"]), layer=int(r["layer"]),
                kv_head=int(r["kv_head"]), mass_mean=float(r["mass_mean"]))
           for r in rows if r["experiment"] == "ada"]
    layers, kvs, caps, mass = allocation_grids(ada, "tova", 12)
    assert layers == [0, 1, 2] and kvs == [0, 1]
    for layer in layers:
        assert caps[layer].sum() == 2 * 12  # a layer's caps hold its total
        for kv in kvs:
            cell = [r for r in ada if r["policy"] == "tova" and r["budget"] == 12
                    and r["layer"] == layer and r["kv_head"] == kv]
            assert caps[layer, kv] == cell[0]["b_h"]
            assert mass[layer, kv] == np.mean([r["mass_mean"] for r in cell])
