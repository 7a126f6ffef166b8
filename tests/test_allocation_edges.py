"""Budget allocation at the edges of the fixed parts: recent tokens or observation window
above the prompt, an empty prompt, a prompt of the whole sequence, a budget at the fixed
parts' minimum; pyramid never gives a layer more than T."""

from __future__ import annotations

import numpy as np
import pytest
from allocation_checks import (ada_reference, dense_scenario, pyramid_reference,
                               random_attention, selectable_scores)

import reference as ref
from kvsim.engine import allocation
from kvsim.engine.experiments import simulate_scenario
from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params
from kvsim.scenario.load import load_scenario


def test_ada_without_candidates_keeps_the_budget_everywhere():
    assert allocation.ada_caps([np.zeros(0)] * 3, 10, 9, 0.2).tolist() == [10, 10, 10]


@pytest.mark.parametrize("B, T, L", [(60, 64, 2), (64, 64, 2), (30, 32, 3), (5, 6, 7),
                                     (1, 1, 4), (40, 41, 30)])
def test_pyramid_caps_each_layer_at_T_and_keeps_the_mean(B, T, L):
    for fixed in sorted({0, B // 2, B - 1}):
        for beta in (1.0, 2.0, 20.0, 1000.0):
            got = allocation.pyramid_budgets(B, fixed, beta, L, T)
            assert got.tolist() == pyramid_reference(B, fixed, beta, L, T)
            assert got.sum() == L * B and got.max() <= T and got.min() >= min(fixed + 1, B)
            assert (np.diff(got) <= 1).all()


def test_pyramid_at_60_of_64_shares_120_keys():
    assert allocation.pyramid_budgets(60, 0, 20.0, 2, 64).tolist() == [64, 56]


ADA_POLICIES = ('[policies.h2o]\nrecent_ratio = 0.75\n'
                '[policies.h2o_offline]\nrecent_ratio = 0.75\n'
                '[policies.snapkv]\nwindow = 12\nkernel = 3\n[policies.tova]\n')


@pytest.mark.parametrize("P, budgets", [
    (0, [13, 20]),      # no prompt: nothing to select
    (6, [13, 20]),      # recent count (9, 15) and window (12) above P
    (14, [14, 20]),     # recent count between P - B and P; window below P
    (40, [14, 40]),     # P = T, and B = T
])
def test_ada_at_the_edges_of_the_fixed_parts(tmp_path, P, budgets):
    rng = np.random.default_rng(P)
    H, T = 3, 40
    attention = random_attention(rng, H, T)
    scenario = load_scenario(dense_scenario(tmp_path, attention, P, budgets, ADA_POLICIES,
                                             'allocation = "ada"\nfloor_share = 0.5'))
    results = simulate_scenario(scenario, progress=False, workers=1)
    p = [ref.normalise_rows(a) for a in attention]
    for config in scenario.experiments[0].policies:
        for B in budgets:
            fixed, scores = zip(*(selectable_scores(config.kind, p[h], P, B, config.params)
                                  for h in range(H)))
            want = ada_reference(list(scores), B, fixed[0], 0.5)
            rows = sorted((r for r in results.rows if r["policy"] == config.label
                           and r["budget"] == B), key=lambda r: r["kv_head"])
            got = [r["b_h"] for r in rows]
            assert got == want and sum(got) == H * B and max(got) <= T, (config.label, B)
            if len(scores[0]) == 0:
                assert got == [B] * H  # no candidates: every head keeps B


@pytest.mark.parametrize("P", [0, 3, 20, 48])
def test_pyramid_at_the_edges_of_the_fixed_parts(tmp_path, P):
    T, L = 48, 3
    (tmp_path / "s.toml").write_text(
        f'[attention]\nsource = "field"\nT = {T}\nheads = 2\nlayers = {L}\n'
        "[attention.recency]\n[attention.noise]\n"
        "[policies.h2o]\nrecent_ratio = 0.75\n[policies.snapkv]\nwindow = 8\nkernel = 3\n"
        "[policies.streaming_llm]\nsinks = 4\n[policies.tova]\n"
        f'[[experiment]]\nprompt_len = {P}\nbudgets = [9, 30, 46, 48]\n'
        'allocation = "pyramid"\nbeta = 2\n')
    scenario = load_scenario(tmp_path / "s.toml")
    results = simulate_scenario(scenario, progress=False, workers=1)
    sizes = results.steps[scenario.experiments[0].name].arrays()["cache_size"]
    for config in scenario.experiments[0].policies:
        policy = POLICIES[config.kind]
        params = resolve_params(policy, config.params)
        for B in (9, 30, 46, 48):  # 9: the minimum of snapkv (window + 1)
            fixed = policy.fixed(B, P, params)
            want = pyramid_reference(B, fixed, 2.0, L, T)
            rows = [r for r in results.rows if r["policy"] == config.label and r["budget"] == B]
            assert sorted({(r["layer"], r["b_h"]) for r in rows}) == list(enumerate(want))
            assert sum(want) == L * B and max(want) <= T
            assert all(sizes[r["unit"]].max(initial=0) <= r["b_h"] for r in rows), config.label
