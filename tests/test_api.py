"""The Python API: attention objects, simulate over policies x budgets, Results, load_report,
bad arguments (one-line KvsimError each), float16/32 matrices and the example script."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matrices import causal_softmax, make_attention

import kvsim
from kvsim.attention.dense import row_sum_tolerance

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "scenarios" / "traces" / "smollm2_gpl3.npz"


def _A(T=24, seed=0):
    return make_attention(T, "softmax", seed)


def _qk(H=4, H_kv=2, T=20, d=8):
    rng = np.random.default_rng(0)
    return rng.normal(size=(H, T, d)), rng.normal(size=(H_kv, T, d)), rng.normal(size=(H_kv, T, d))


def test_many_policies_and_budgets_equal_single_runs():
    A = _A()
    att = kvsim.Attention.from_probs(A, important=[2, 9])
    policies = ["full", "window", "streaming_llm", "h2o", "h2o_offline", "tova", "oracle"]
    res = kvsim.simulate(att, policies=policies, budgets=[6, 10], prompt_len=12, workers=2)
    assert len(res.rows) == len(policies) * 2 and res.policies == policies
    for policy in policies:
        for budget in (6, 10):
            one = kvsim.simulate(A, policy, budget, 12, important=[2, 9])
            assert np.array_equal(res.mass(policy, budget)[0], one.mass)
            assert np.array_equal(res.series("cache_size", policy, budget)[0], one.cache_size)
            row = res.select(policy, budget)[0]
            assert row["kept"] == one.kept.size and row["final_recall"] == one.final_recall


def test_results_do_not_depend_on_workers_and_heads_run_in_gqa_groups():
    q, k, v = _qk()
    att = kvsim.Attention.from_qk(q, k, v)
    kw = dict(policies=["h2o", "snapkv", "random"], budgets=[8, 12], prompt_len=12, seeds=[0, 3])
    kw["window"] = 4
    a, b = kvsim.simulate(att, workers=1, **kw), kvsim.simulate(att, workers=2, **kw)
    assert a.to_csv() == b.to_csv()
    assert {r["head"] for r in a.rows} == set(range(4)) and {r["kv_head"] for r in a.rows} == {0, 1}
    assert np.isfinite(a.series("error", "h2o", 8)).all()  # values give the output error


def test_an_attention_owns_its_data():
    """Not a view of the caller's array, which could change after the checks
    (tests/test_api_inputs.py writes NaNs into it)."""
    A = _A(64)
    for check in (True, False):
        att = kvsim.Attention.from_probs(A, check=check)
        assert not np.shares_memory(att.field().data.probs, A)
        assert np.array_equal(att.field().data.probs[0], A)
    stack = np.stack([A, _A(64, 1)])
    assert not np.shares_memory(kvsim.Attention.from_probs(stack).field().data.probs, stack)


def test_rows_off_within_tolerance_are_renormalised_in_a_copy():
    A = _A(16)
    B = A * (1 + 3e-6)
    att = kvsim.Attention.from_probs(B)
    probs = att.field().data.probs[0]
    assert not np.shares_memory(probs, B) and np.allclose(probs.sum(axis=1), 1, atol=1e-15)
    assert np.array_equal(B, A * (1 + 3e-6))  # the caller's matrix is untouched


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_lower_precision_probabilities_are_accepted(dtype):
    A = causal_softmax(np.random.default_rng(1).normal(scale=2, size=(300, 300)))
    low = A.astype(dtype)
    assert np.abs(low.astype(np.float64).sum(axis=1) - 1).max() > 1e-5 or dtype is np.float32
    r = kvsim.simulate(low, "h2o", 32, 150)
    ref = kvsim.simulate(low.astype(np.float64) / low.astype(np.float64).sum(1, keepdims=True),
                         "h2o", 32, 150)
    assert np.array_equal(r.mass, ref.mass)


@pytest.mark.parametrize("entry, value, message", [
    ((7, 2), -1e-300, "row 7 has a negative entry"),
    ((7, 2), np.nan, "row 7 is not"),
    ((7, 2), np.inf, "row 7 is not"),
    ((7, 2), -np.inf, "row 7 is not"),
    ((7, 9), 5e-324, "row 7 attends to a later key"),
    ((7, 9), np.nan, "row 7 is not"),
    ((7, 9), -np.nan, "row 7 is not"),
    ((3, 1), 0.75, "row 3 sums to"),
])
def test_the_input_check_names_the_first_bad_row(entry, value, message):
    A = _A(16)
    A[entry] = value
    with pytest.raises(kvsim.KvsimError, match=message):
        kvsim.Attention.from_probs(A)


@pytest.mark.parametrize("row", [0, 1049, 1050, 2099])
def test_a_matrix_checked_in_two_halves_names_its_first_bad_row(row):
    T = 2100  # 2100^2 entries: read on two threads where Numba has two
    A = np.tril(np.ones((T, T)))
    A /= A.sum(axis=1, keepdims=True)
    A[row, 0] = np.nan
    A[2099, 1] = -1.0  # a later bad row does not hide the first
    with pytest.raises(kvsim.KvsimError, match=f"row {row} is not"):
        kvsim.Attention.from_probs(A)


def test_negative_zeros_are_valid_probabilities():
    A = _A(16)
    A[5, :6] = [0.5, -0.0, 0.25, 0.25, -0.0, 0.0]
    A[9, 12] = -0.0  # above the diagonal: still zero
    att = kvsim.Attention.from_probs(A)
    assert np.array_equal(att.field().data.probs[0], A)  # accepted as they are


def test_row_sum_tolerance_rule():
    assert row_sum_tolerance(np.float64, 4096) == pytest.approx(1e-5)
    assert row_sum_tolerance(np.float16, 1) == pytest.approx(1e-5 + 2**-10, rel=1e-3)
    assert row_sum_tolerance(np.float16, 4096) > row_sum_tolerance(np.float16, 16)
    A = _A(16).astype(np.float16)
    A[5, :6] *= np.float16(1.01)  # off by 1 %: beyond float16 rounding
    with pytest.raises(kvsim.KvsimError, match="row 5"):
        kvsim.Attention.from_probs(A)


def test_logits_in_every_precision_match_their_softmax():
    L = np.random.default_rng(2).normal(size=(2, 20, 20))
    for dtype in (np.float16, np.float32, np.float64):
        low = L.astype(dtype)
        att = kvsim.Attention.from_logits(low)
        want = np.stack([causal_softmax(m.astype(np.float64)) for m in low])
        assert np.allclose(att.field().data.probs, want, atol=1e-15)


def test_budgets_beyond_the_sequence_give_the_run_at_the_sequence_length():
    A = _A(20)
    for policy in ("window", "h2o", "snapkv", "streaming_llm", "tova", "random", "oracle"):
        near = kvsim.simulate(A, policy, 40, 8)
        huge = kvsim.simulate(A, policy, 10**9, 8)
        assert np.array_equal(near.mass, huge.mass) and np.array_equal(near.kept, huge.kept)


def test_recorded_caches_end_in_the_final_cache(tmp_path):
    A = _A(30)
    res = kvsim.simulate(kvsim.Attention.from_probs(A), policies=["h2o", "full", "snapkv"],
                         budgets=[8, 12], prompt_len=10, record=("kept",), window=4)
    for policy in ("h2o", "snapkv"):
        for budget in (8, 12):
            kept = res.kept(policy, budget)
            assert kept.shape == (20, budget)
            final = kvsim.simulate(A, policy, budget, 10, **({"window": 4} if policy == "snapkv" else {})).kept
            assert np.array_equal(np.sort(kept[-1][kept[-1] >= 0]), final)
            assert ((kept >= 0).sum(axis=1) == res.series("cache_size", policy, budget)[0]).all()
    assert res.kept("full", 8).shape == (20, 30)
    assert res.plot("kept_raster", tmp_path)  # drawn from the recorded caches


def test_attention_objects_are_reused_without_new_full_passes():
    att = kvsim.Attention.from_spec({"T": 256, "heads": 2, "sinks": {"count": 4, "strength": 6.0},
                                     "noise": {"kind": "gaussian", "scale": 0.5}})
    first = kvsim.simulate(att, policies=["h2o"], budgets=[32], prompt_len=128, seeds=[0, 1])
    memo = att.passes(0)
    kept = dict(memo)
    second = kvsim.simulate(att, policies=["h2o"], budgets=[32], prompt_len=128, seeds=[0, 1])
    assert memo == kept and all(memo[k] is kept[k] for k in kept)
    assert first.to_csv() == second.to_csv()
    assert first.select(seed=0)[0]["mass_mean"] != first.select(seed=1)[0]["mass_mean"]


def test_a_spec_gives_the_report_of_the_same_scenario(tmp_path):
    spec = {"T": 300, "heads": 2, "sinks": {"count": 4, "strength": 5.0},
            "recency": {"kind": "power", "alpha": 0.8},
            "heavy_hitters": {"count": 6, "strength": 6.0}}
    toml = (tmp_path / "s.toml")
    toml.write_text('name = "s"\nseeds = [0, 1]\n[attention]\nsource = "field"\nT = 300\nheads = 2\n'
                    '[attention.sinks]\ncount = 4\nstrength = 5.0\n[attention.recency]\nkind = "power"\n'
                    'alpha = 0.8\n[attention.heavy_hitters]\ncount = 6\nstrength = 6.0\n'
                    '[policies.h2o]\n[policies.window]\n[policies.random]\n[[experiment]]\nname = "decode"\n'
                    'prompt_len = 200\nbudgets = [16, 48]\n[output]\nformats = ["png"]\n')
    out = kvsim.run(toml, tmp_path / "s", workers=1)  # named as the scenario: the same titles
    report = kvsim.load_report(out)
    res = kvsim.simulate(kvsim.Attention.from_spec(spec), policies=["h2o", "window", "random"],
                         budgets=[16, 48], prompt_len=200, seeds=[0, 1])
    assert len(report.rows) == len(res.rows)
    for a, b in zip(report.rows, res.rows):
        for col in ("policy", "budget", "seed", "head", "mass_mean", "final_recall", "kept"):
            # results.csv holds 12 significant digits (the same file on any CPU)
            assert a[col] == pytest.approx(b[col], rel=1e-11, nan_ok=True), col
    assert np.array_equal(report.mass("h2o", 16), res.mass("h2o", 16))
    assert report.kept("h2o", 48).shape[1] == 48  # the report's snapshots at its focus budget
    with open(out / "results.csv", newline="") as f:
        assert f.read() == report.to_csv()  # rows read back as the run wrote them
    paths = report.plot("mass_over_time", tmp_path / "figs", formats=("png", "svg"))
    assert [p.suffix for p in paths] == [".png", ".svg"] and all(p.stat().st_size > 0 for p in paths)
    # The figure drawn from the rows read back is the report's own, byte for byte.
    assert paths[0].read_bytes() == (out / "decode_mass_over_time.png").read_bytes()
    pytest.importorskip("pandas")
    frame = report.to_pandas()
    assert list(frame.columns) == list(report.rows[0]) and len(frame) == len(report.rows)


def test_trace_attention_has_values_and_the_gqa_layout():
    att = kvsim.Attention.from_trace(TRACE, T=256, kv_head_ids=[1])
    assert (att.T, att.heads, att.kv_heads) == (256, 3, 1)
    res = kvsim.simulate(att, policies=["tova"], budgets=[32], prompt_len=128)
    assert [r["head"] for r in res.rows] == [0, 1, 2] and np.isfinite(res.rows[0]["error_mean"])


def test_the_example_script_compares_six_policies_and_saves_a_figure(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "compare_policies.py"), "--out",
                           str(tmp_path)], capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    table = [line.split() for line in lines if line.split()[0] in
             ("window", "streaming_llm", "h2o", "snapkv", "tova", "oracle")]
    assert len(table) == 6 and all(len(t) == 5 for t in table)
    oracle = [float(x) for x in table[-1][1:]]
    assert oracle == sorted(oracle) and all(0 < x <= 1 for x in oracle)
    assert (tmp_path / "simulate_mass_vs_budget.png").stat().st_size > 0


# ------------------------------------------------------------------ bad arguments

A10 = _A(10)
QKV = _qk()


def _call(**kw):
    args = dict(policies=["h2o"], budgets=[4], prompt_len=5)
    args.update(kw)
    return lambda: kvsim.simulate(A10, **args)


def _single(*args, **kw):
    return lambda: kvsim.simulate(*args, **kw)


BAD_CALLS = {
    "policy-None": _single(A10, None, 4, 5),
    "policy-int": _single(A10, 3, 4, 5),
    "policy-unknown": _single(A10, "h2", 4, 5),
    "budget-None": _single(A10, "h2o", None, 5),
    "budget-float": _single(A10, "h2o", 4.0, 5),
    "budget-bool": _single(A10, "h2o", True, 5),
    "budget-2**70": _single(A10, "h2o", 2**70, 5),
    "budget-string": _single(A10, "h2o", "4", 5),
    "budget-negative": _single(A10, "window", -3, 5),
    "prompt_len-None": _single(A10, "h2o", 4, None),
    "prompt_len-float": _single(A10, "h2o", 4, 5.0),
    "prompt_len-too-long": _single(A10, "h2o", 4, 11),
    "prompt_len-2**70": _single(A10, "h2o", 4, 2**70),
    "seed-negative": _single(A10, "random", 4, 5, seed=-1),
    "seed-float": _single(A10, "random", 4, 5, seed=1.5),
    "seed-bool": _single(A10, "random", 4, 5, seed=True),
    "seed-2**64": _single(A10, "random", 4, 5, seed=2**64),
    "important-empty": _single(A10, "h2o", 4, 5, important=[]),
    "important-float": _single(A10, "h2o", 4, 5, important=[1.5]),
    "important-out-of-range": _single(A10, "h2o", 4, 5, important=[10]),
    "important-negative": _single(A10, "h2o", 4, 5, important=[-1]),
    "important-2d": _single(A10, "h2o", 4, 5, important=[[1, 2]]),
    "important-string": _single(A10, "h2o", 4, 5, important="3"),
    "important-bool": _single(A10, "h2o", 4, 5, important=[True, False]),
    "param-unknown": _single(A10, "h2o", 4, 5, recent=0.5),
    "param-wrong-type": _single(A10, "h2o", 4, 5, recent_ratio="half"),
    "param-nan": _single(A10, "h2o", 4, 5, recent_ratio=float("nan")),
    "param-bool-for-int": _single(A10, "streaming_llm", 6, 5, sinks=True),
    "matrix-list-of-strings": _single([["a"]], "h2o", 4, 5),
    "matrix-1d": _single(np.ones(4), "h2o", 4, 5),
    "matrix-empty": _single(np.zeros((0, 0)), "h2o", 4, 0),
    "matrix-complex": _single(A10.astype(complex), "h2o", 4, 5),
    "matrix-bool": _single(np.eye(3, dtype=bool), "h2o", 1, 1),
    "matrix-object": _single(np.array([[None]]), "h2o", 1, 1),
    "matrix-nan": _single(np.where(np.eye(10) > 0, np.nan, A10), "h2o", 4, 5),
    "matrix-two-heads-single-form": _single(np.stack([A10, A10]), "h2o", 4, 5),
    "policies-None-with-budgets": _call(policies=None),
    "policies-empty": _call(policies=[]),
    "policies-string": _call(policies="h2o"),
    "policies-int-entry": _call(policies=[1]),
    "policies-duplicate": _call(policies=["h2o", "h2o"]),
    "policies-dict-bad-kind": _call(policies={"a": {"kind": "nope"}}),
    "policies-dict-not-table": _call(policies={"a": 3}),
    "budgets-empty": _call(budgets=[]),
    "budgets-int": _call(budgets=4),
    "budgets-duplicate": _call(budgets=[4, 4]),
    "budgets-float": _call(budgets=[1.5]),  # neither tokens nor a prompt fraction
    "budgets-below-floor": _call(policies=["streaming_llm"], budgets=[4]),
    "seeds-empty": _call(seeds=[]),
    "seeds-negative": _call(seeds=[-1]),
    "seeds-duplicate": _call(seeds=[1, 1]),
    "seeds-and-seed": _call(seeds=[1], seed=2),
    "record-unknown": _call(record=("mass",)),
    "workers-zero": _call(workers=0),
    "workers-float": _call(workers=1.5),
    "check-string": _call(check="no"),
    "param-no-policy-has": _call(sinks=4),
    "policy-and-policies": _call(policy="h2o"),
    "important-with-attention-object": lambda: kvsim.simulate(
        kvsim.Attention.from_probs(A10), policies=["h2o"], budgets=[4], prompt_len=5, important=[1]),
    "kv_heads-not-divisor": lambda: kvsim.Attention.from_probs(np.stack([A10] * 3), kv_heads=2),
    "kv_heads-float": lambda: kvsim.Attention.from_probs(A10, kv_heads=1.0),
    "gqa-unknown": lambda: kvsim.Attention.from_probs(A10, gqa="median"),
    "logits-inf-diagonal": lambda: kvsim.Attention.from_logits(np.full((3, 3), -np.inf)),
    "logits-1d": lambda: kvsim.Attention.from_logits(np.zeros(3)),
    "qk-2d-queries": lambda: kvsim.Attention.from_qk(np.zeros((3, 4)), QKV[1]),
    "qk-heads-not-multiple": lambda: kvsim.Attention.from_qk(QKV[0][:3], QKV[1]),
    "qk-length-mismatch": lambda: kvsim.Attention.from_qk(QKV[0], QKV[1][:, :5]),
    "qk-values-mismatch": lambda: kvsim.Attention.from_qk(QKV[0], QKV[1], QKV[2][:1]),
    "qk-nan": lambda: kvsim.Attention.from_qk(np.full_like(QKV[0], np.nan), QKV[1]),
    "qk-int-dtype": lambda: kvsim.Attention.from_qk(QKV[0].astype(int), QKV[1]),
    "qk-scaling-negative": lambda: kvsim.Attention.from_qk(QKV[0], QKV[1], scaling=-1.0),
    "qk-scaling-nan": lambda: kvsim.Attention.from_qk(QKV[0], QKV[1], scaling=float("nan")),
    "qk-scaling-vector": lambda: kvsim.Attention.from_qk(QKV[0], QKV[1], scaling=[1.0]),
    "spec-not-dict": lambda: kvsim.Attention.from_spec("T = 4"),
    "spec-bad-T": lambda: kvsim.Attention.from_spec({"T": -1}),
    "spec-unknown-key": lambda: kvsim.Attention.from_spec({"T": 64, "sink": {}}),
    "spec-unknown-source": lambda: kvsim.Attention.from_spec({"source": "nope"}),
    "trace-missing": lambda: kvsim.Attention.from_trace("no/such/trace.npz"),
    "trace-bad-layer": lambda: kvsim.Attention.from_trace(TRACE, layer=99),
    "series-unknown-metric": lambda: kvsim.simulate(A10, policies=["h2o"], budgets=[4],
                                                    prompt_len=5).series("masses"),
    "kept-not-recorded": lambda: kvsim.simulate(A10, policies=["h2o"], budgets=[4],
                                                prompt_len=5).kept("h2o", 4),
    "plot-unknown-figure": lambda: kvsim.simulate(A10, policies=["h2o"], budgets=[4],
                                                  prompt_len=5).plot("heatmap", "/nonexistent"),
    "plot-recall-without-truth": lambda: kvsim.simulate(A10, policies=["h2o"], budgets=[4],
                                                        prompt_len=5).plot("pareto", "/nonexistent"),
    "load_report-missing": lambda: kvsim.load_report("no/such/report"),
}


@pytest.mark.quick
@pytest.mark.parametrize("name", list(BAD_CALLS))
def test_bad_api_calls_raise_one_line_kvsim_errors(name):
    with pytest.raises(kvsim.KvsimError) as info:
        BAD_CALLS[name]()
    message = str(info.value)
    assert message and "\n" not in message and len(message) < 400, message


def test_bench_rows_of_the_api_agree_with_the_numpy_peer():
    from kvsim.tools.bench import api_versus_numpy
    r = api_versus_numpy(96, {"prefill_heavy": (48, 16), "decode_heavy": (16, 8)}, [8, 16], 1)
    assert r["check"]["ratio"] > 0 and r["budgets"]["speedup"] > 0
    assert all(r[k]["trusted_speedup"] > 0 for k in ("prefill_heavy", "decode_heavy"))


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_matrix_sources_accept_lower_precision(tmp_path, dtype):
    A = causal_softmax(np.random.default_rng(3).normal(scale=2, size=(200, 200))).astype(dtype)
    np.save(tmp_path / "a.npy", A)
    (tmp_path / "s.toml").write_text('[attention]\nsource = "matrix"\npath = "a.npy"\n'
                                     '[policies.h2o]\n[[experiment]]\nprompt_len = 100\nbudgets = [20]\n')
    scenario = kvsim.load_scenario(tmp_path / "s.toml")
    probs = scenario.field(0).data.probs[0]
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-15)
    assert np.array_equal(probs, kvsim.Attention.from_probs(A).field().data.probs[0])


def test_recording_caches_warns_its_memory_once():
    from kvsim.api.simulate import RecordCostWarning
    att = kvsim.Attention.from_probs(_A(T=40))
    call = dict(policies=["h2o", "window"], budgets=[8, 16], prompt_len=20, seeds=[0, 1])
    with pytest.warns(RecordCostWarning, match=r"about 15\.0 KiB") as caught:
        # 8 B x 20 steps x (8 + 16) slots x 2 policies x 2 seeds
        kvsim.simulate(att, record=("kept",), **call)
        kvsim.simulate(att, record=("kept",), **call)  # the same estimate: not said again
    assert len(caught) == 1
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvsim.simulate(att, **call)  # nothing recorded: no warning


def test_plot_returns_a_figure_and_saves_only_when_asked(tmp_path):
    from matplotlib.figure import Figure
    res = kvsim.simulate(kvsim.Attention.from_probs(_A()), policies=["h2o", "window"],
                         budgets=[6, 10], prompt_len=12)
    fig = res.plot("mass_vs_budget")
    assert isinstance(fig, Figure) and fig.axes and not list(tmp_path.iterdir())
    paths = res.plot("mass_vs_budget", tmp_path)
    assert [p.name for p in paths] == ["simulate_mass_vs_budget.png"] or all(
        p.exists() for p in paths)


def test_a_missing_series_is_an_error_naming_what_is_missing():
    res = kvsim.simulate(kvsim.Attention.from_probs(_A()), policies=["h2o"], budgets=[6],
                         prompt_len=12)
    with pytest.raises(kvsim.KvsimError, match="'error' needs value vectors"):
        res.series("error", "h2o", 6)
    with pytest.raises(kvsim.KvsimError, match="'recall' needs ground-truth"):
        res.series("recall", "h2o", 6)
    assert res.series("mass", "h2o", 6).shape == (1, 12)


def test_budgets_take_prompt_fractions_as_files_do():
    att = kvsim.Attention.from_probs(_A(T=40))
    res = kvsim.simulate(att, policies=["h2o"], budgets=[0.25, 0.5], prompt_len=30)
    assert res.budgets == [8, 15]  # 7.5 -> 8 (half up), 15
    assert kvsim.simulate(_A(T=40), "h2o", 0.25, 30).budget == 8
    with pytest.raises(kvsim.KvsimError, match=r"budgets\[1\]: expected distinct budgets, "
                                               r"got 8 again \(= 8 tokens\)"):
        kvsim.simulate(att, policies=["h2o"], budgets=[0.25, 8], prompt_len=30)
    with pytest.raises(kvsim.KvsimError, match="at least 1 token"):
        kvsim.simulate(att, policies=["h2o"], budgets=[0.01], prompt_len=30)


def test_single_result_repr_is_short():
    r = kvsim.simulate(_A(T=200), "h2o", 16, 100, important=[3, 40])
    text = repr(r)
    assert text.startswith("SimulationResult(h2o, budget 16, prompt_len 100: 100 decode steps")
    assert "final recall" in text and len(text) < 160


def test_torch_tensors_are_converted_or_refused_with_kvsims_error():
    torch = pytest.importorskip("torch")
    L = np.log(_A(T=30) + 1e-30)
    expected = kvsim.simulate(kvsim.Attention.from_logits(L.astype(np.float32)), "h2o", 8, 15)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        tensor = torch.tensor(L, dtype=torch.float64).to(dtype)
        att = kvsim.Attention.from_logits(tensor)  # any float dtype: converted exactly
        exact = tensor.float().numpy() if dtype == torch.bfloat16 else tensor.numpy()
        assert np.array_equal(kvsim.simulate(kvsim.Attention.from_logits(exact), "h2o", 8,
                                             15).mass, kvsim.simulate(att, "h2o", 8, 15).mass)
    assert kvsim.simulate(torch.tensor(_A(T=30)), "h2o", 8, 15).mass.shape == expected.mass.shape
    with pytest.raises(kvsim.KvsimError, match="^probs: expected"):  # kvsim's error, not torch's
        kvsim.simulate(torch.tril(torch.ones((4, 4), dtype=torch.int32)), "h2o", 2, 2)
    with pytest.raises(kvsim.KvsimError, match="^logits: expected"):
        kvsim.Attention.from_logits(torch.zeros((4, 4), dtype=torch.complex64))
