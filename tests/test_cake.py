"""CAKE (antgroup/cakekv at c4675ce): the layer preference, ``adjust_budgets`` and the
prefill rating against a NumPy transcription of the authors' PyTorch arithmetic; the
engine's per-layer caps and kept sets on a field with layers."""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from kvsim.engine import allocation
from kvsim.engine.experiments import simulate_scenario
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params
from kvsim.scenario.load import load_scenario

# ------------------------------------------- transcription of the authors' arithmetic
# Written from cake/utils.py and cake/model/modify_llama.py (prefill branch) of the
# commit above, tensor for tensor: attention (heads, window queries, keys).


def authors_preference(attn: np.ndarray, window: int, tau1: float, tau2: float) -> float:
    """calculate_entropy over the window queries x prefix keys of every head, times the
    summed unbiased variance over the queries (torch.var's default), as pref_score."""
    part = attn[:, -window:, :-window]
    disp = -np.sum(part * np.log(part + 1e-10))
    var = np.var(part, axis=-2, ddof=1).sum()
    return float(disp ** (1 / tau1) * var ** (1 / tau2))


def authors_adjust_budgets(budget_list, total_budget, seq_len, layer_nums):
    """adjust_budgets, step by step in the authors' order."""
    b = np.array(budget_list, dtype=int)
    excess = np.maximum(b - seq_len, 0)
    b = np.minimum(b, seq_len)
    total_excess = np.sum(excess)
    if total_excess > 0:
        valid = b < seq_len
        if np.sum(valid) > 0:
            b[valid] += total_excess // np.sum(valid)
            b[np.where(valid)[0][:total_excess % np.sum(valid)]] += 1
    diff = total_budget - np.sum(b)
    if diff != 0:
        valid = b < seq_len if diff > 0 else b > 1
        count = np.sum(valid)
        if count > 0:
            if diff > 0:
                b[valid] += abs(diff) // count
                b[np.where(valid)[0][:abs(diff) % count]] += 1
            else:
                b[valid] -= abs(diff) // count
                b[np.where(valid)[0][:abs(diff) % count]] -= 1
    return b.tolist()


def authors_layer_budgets(prefs, cache_size, window, seq_len):
    """CakeprefillKVCache: total (cache_size - window) * L shared in proportion, adjusted,
    each capped at seq_len - window (the hh_size of the layer); then kvsim's floor."""
    total = (cache_size - window) * len(prefs)
    shares = [p / sum(prefs) * total for p in prefs]
    adjusted = authors_adjust_budgets(shares, total, seq_len - window, len(prefs))
    return floored([min(b, seq_len - window) for b in adjusted], total)


def floored(shares: list[int], total: int) -> list[int]:
    """kvsim's floor on the authors' shares (docs/allocation-rules.md): a layer left no
    selectable slot gets one; while they sum above total, the largest share (the earliest
    among equals) gives one back."""
    shares = [max(b, 1) for b in shares]
    while sum(shares) > total:
        shares[shares.index(max(shares))] -= 1
    return shares


def authors_hh_score(attn: np.ndarray, window: int, gamma: float, group: int) -> np.ndarray:
    """mean + gamma * var over the window queries, cut to the prefix, avg_pool1d(5,
    padding 2, zero padding counted), then the mean over each KV head's query heads."""
    a = attn[:, -window:, :]
    score = a.mean(axis=-2) + gamma * a.var(axis=-2, ddof=1)
    score = score[:, :-window]
    padded = np.pad(score, ((0, 0), (2, 2)))
    pooled = sum(padded[:, i:i + score.shape[1]] for i in range(5)) / 5
    return pooled.reshape(-1, group, pooled.shape[1]).mean(axis=1)


def _window_attention(rng, heads: int, P: int, window: int) -> np.ndarray:
    """(heads, window, P) causal attention of the last window queries of a prompt."""
    logits = rng.standard_normal((heads, window, P)) * 2
    q = np.arange(P - window, P)[:, None]
    logits = np.where(np.arange(P)[None, :] <= q, logits, -np.inf)
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@pytest.mark.parametrize("case", range(8))
def test_preference_matches_the_authors_arithmetic(case):
    rng = np.random.default_rng(case)
    P, w = int(rng.integers(40, 90)), 32
    attn = _window_attention(rng, 3, P, w)
    tau1, tau2 = rng.uniform(0.4, 2.3, 2)
    got = allocation.cake_preference(list(attn), P - w, tau1, tau2)
    assert got == pytest.approx(authors_preference(attn, w, tau1, tau2), rel=1e-12)


@pytest.mark.parametrize("case", range(200))
def test_adjust_budgets_matches_the_authors_code(case):
    rng = np.random.default_rng(case)
    L = int(rng.integers(1, 12))
    seq_len = int(rng.integers(1, 60))
    total = int(rng.integers(0, L * seq_len + 1))
    prefs = rng.random(L) ** rng.uniform(1, 8)  # from even to very skewed
    shares = list(prefs / prefs.sum() * total)
    want = authors_adjust_budgets(shares, total, seq_len, L)
    assert allocation.adjust_budgets(shares, total, seq_len).tolist() == want


@pytest.mark.parametrize("case", range(100))
def test_layer_caps_match_the_authors_code(case):
    rng = np.random.default_rng(1000 + case)
    L, w = int(rng.integers(2, 10)), 32
    P = int(rng.integers(w + 2, 300))
    B = int(rng.integers(w + 1, P))
    prefs = rng.random(L) ** rng.uniform(1, 10)
    want = [w + b for b in authors_layer_budgets(list(prefs), B, w, P)]
    got = allocation.cake_caps(prefs, B, w, P)
    assert got.tolist() == want
    assert got.sum() <= L * B and (got <= P).all() and (got > w).all()


def test_a_share_of_zero_is_floored_at_one_selectable_slot():
    """One slot per layer to share (B = window + 1): the authors' shares leave a layer
    none (its cap would be the window alone, which the kernels cannot run), kvsim gives
    it one from the largest share."""
    prefs = np.array([5.0, 3.0, 1.0, 0.01])
    assert authors_adjust_budgets(list(prefs / prefs.sum() * 4), 4, 58, 4) == [3, 1, 0, 0]
    assert allocation.cake_caps(prefs, 33, 32, 90).tolist() == [33, 33, 33, 33]
    prefs = np.array([10.0, 10.0, 0.001])  # [3, 3, 0]: the earliest largest gives back
    assert authors_adjust_budgets(list(prefs / prefs.sum() * 6), 6, 58, 3) == [3, 3, 0]
    assert allocation.cake_caps(prefs, 34, 32, 90).tolist() == [34, 35, 33]


@pytest.mark.parametrize("case", range(6))
def test_prefill_rating_matches_the_authors_hh_score(case):
    """The cake policy's prefill ranking is the authors' hh_score (mean over a group)."""
    rng = np.random.default_rng(50 + case)
    heads, window = 2, int(rng.integers(2, 9))
    P = int(rng.integers(window + 3, 40))
    T = P
    logits = rng.standard_normal((heads, T, T)) * 2
    probs = ref.causal_probs(logits)
    from kvsim.numerics.field import dense_field
    field = dense_field(probs, 1)
    group = make_group(field, 0, P, np.zeros((heads, T), bool), {})
    params = resolve_params(POLICIES["cake"], {"window": window, "gamma": 200.0})
    got = POLICIES["cake"].prefill_score(group, 0, params)
    want = authors_hh_score(probs[:, :P, :P][:, P - window:, :], window, 200.0, heads)[0]
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)


def test_cake_caps_and_kept_sets_on_a_field_with_layers(tmp_path):
    (tmp_path / "s.toml").write_text(
        '[attention]\nsource = "field"\nT = 120\nheads = 4\nkv_heads = 2\nlayers = 3\n'
        "[attention.recency]\n[attention.noise]\n[attention.sinks]\n"
        "[policies.cake]\nwindow = 32\n[policies.tova]\n"
        '[[experiment]]\nname = "c"\nprompt_len = 96\nbudgets = [40, 64]\n'
        'allocation = "cake"\ntau1 = 1.6\ntau2 = 0.6\n')
    scenario = load_scenario(tmp_path / "s.toml")
    results = simulate_scenario(scenario, progress=False, workers=1)
    kept = results.steps["c"].arrays()["kept"]
    P, w = 96, 32
    prefs = []
    for layer in range(3):  # the authors' preference from the layer's window attention
        rows = np.stack(allocation.layer_window_rows(scenario.field(0, layer).data, P, w))
        prefs.append(authors_preference(rows, w, 1.6, 0.6))
    for r in results.rows:
        fixed = w if r["kind"] == "cake" else 0
        budgets = authors_layer_budgets(prefs, r["budget"] - fixed + w, w, P - fixed + w)
        assert r["b_h"] == fixed + budgets[r["layer"]], r
        field = scenario.field(r["seed"], r["layer"]).data
        group = make_group(field, r["kv_head"], P, np.zeros((4, 120), bool), {})
        policy = POLICIES[r["kind"]]
        want = policy.run(group, r["b_h"], resolve_params(policy, {})).kept
        got = kept[r["unit"]]
        assert got[got >= 0].tolist() == want.tolist()
    for layer in range(3):
        caps = {r["b_h"] for r in results.rows if r["layer"] == layer and r["budget"] == 40
                and r["kind"] == "cake"}
        assert len(caps) == 1  # every KV head of a layer gets the layer's cap
    assert len({r["b_h"] for r in results.rows if r["budget"] == 40
                and r["kind"] == "cake"}) > 1  # the layers differ
