"""The benchmark's NumPy baselines implement the same simulation as kvsim; its breakdown
times the parts of the real computation."""

import numpy as np
import pytest

import kvsim
from kvsim.tools.bench import bench_field, dense_matrix, exp_rate
from kvsim.tools.bench.breakdown import PARTS, _key_terms, _noise, breakdown
from kvsim.tools.bench.numpy_baseline import BASELINES
from kvsim.numerics.field import logits_row


@pytest.mark.parametrize("policy", sorted(BASELINES))
@pytest.mark.parametrize("T, P, B", [(96, 48, 40), (96, 16, 40), (64, 64, 40), (80, 0, 36)])
def test_numpy_baselines_agree_with_kvsim(policy, T, P, B):
    A = dense_matrix(T)
    ours = kvsim.simulate(A, policy, B, P)
    mass, kept = BASELINES[policy](A, P, B)
    assert np.allclose(ours.mass, mass, rtol=0, atol=1e-9)
    assert np.array_equal(np.sort(kept), ours.kept)


def test_dense_matrix_is_the_bench_field():
    A = dense_matrix(48)
    assert np.allclose(A.sum(axis=1), 1.0) and not np.triu(A, 1).any()
    assert bench_field(48, noise=False).key_bias[0, :4].min() == 6.0


def test_exp_rate_is_measured():
    assert exp_rate() > 1e6


def test_breakdown_times_the_parts_of_the_real_logit():
    noisy, plain = bench_field(64, noise=True), bench_field(64, noise=False)
    keys, buf, sums = np.arange(64), np.empty(64), np.zeros(64)
    # the timed parts, run one after the other, compute the field's own logits
    _key_terms(plain, 63, keys, buf, sums)
    _noise(noisy, 63, keys, buf, sums)
    expected = np.empty(64)
    logits_row(noisy, 0, 63, keys, 64, expected, np.empty(64))
    assert np.array_equal(buf, expected)
    costs = breakdown(noisy, plain, rows=4)
    assert list(costs) == list(PARTS) and all(ns > 0 for ns in costs.values())


def test_qk_peer_computes_what_the_full_pass_computes():
    from kvsim.numerics.fullpass import full_pass
    from kvsim.tools.bench.ratios import numpy_qk_pass, qk_field, qk_versus_numpy

    field = qk_field(96, 8)
    fp = full_pass(field, 0, 80)
    top, total, prompt, decode = numpy_qk_pass(field.queries[0].astype(np.float64),
                                               field.keys[0].T.astype(np.float64),
                                               float(field.qk_scale[0]), 80)
    assert np.allclose(top, fp.row_max, rtol=0, atol=1e-12)
    assert np.allclose(total, fp.row_sum, rtol=1e-12)
    assert np.allclose(prompt, fp.prompt_colsum, rtol=0, atol=1e-12)
    assert np.allclose(decode, fp.decode_colsum, rtol=0, atol=1e-12)
    row = qk_versus_numpy(64, 8, repeats=1)
    assert row["speedup"] == row["numpy_s"] / row["kvsim_s"] > 0


def test_pass_floor_counts_the_flagship_passes():
    from pathlib import Path

    from kvsim.tools.bench import SCENARIO
    from kvsim.tools.bench.ratios import pass_floor

    floor = pass_floor(Path(SCENARIO), rate=1e9)
    assert floor["passes"] == 5 * 4  # five seeds, four heads, one prompt length
    assert floor["seconds"] == floor["entries"] / 1e9 == 20 * 34816 * 34817 / 2 / 1e9


def test_full_pass_rate_is_timed_with_its_ceiling():
    from kvsim.tools.bench import full_pass_rate

    rate, ceiling = full_pass_rate(1280, noise=True, threads=2)
    assert rate > 0 and ceiling > 2 * 1e6  # two threads' worth of NumPy exp


def test_only_api_rows_replace_the_api_rows_of_bench_json(tmp_path, monkeypatch, capsys):
    import json

    import kvsim.tools.bench as bench
    from kvsim.errors import KvsimError

    small = {"T": 256, "settings": {"prefill_heavy": (128, 32), "decode_heavy": (64, 16)},
             "budgets": [16, 32]}
    config = {**bench.bench_config(True), "api": small}
    monkeypatch.setattr(bench, "bench_config", lambda quick: config)
    (tmp_path / "bench.json").write_text(json.dumps({"machine": {}, "config": config,
                                                     "api": {}, "scaling": {"4096": 1}}))
    bench.run_only("api", True, tmp_path)
    written = json.loads((tmp_path / "bench.json").read_text())
    assert written["scaling"] == {"4096": 1}  # other rows kept as they were
    assert written["api"]["decode_heavy"]["trusted_speedup"] > 0 and "load" in written["api"]
    assert "API vs NumPy h2o decode_heavy" in capsys.readouterr().out
    monkeypatch.setattr(bench, "bench_config",
                        lambda quick: {**config, "api": {**small, "T": 512}})
    with pytest.raises(KvsimError, match="same sizes"):
        bench.run_only("api", True, tmp_path)
    bench.run_only("api", True, tmp_path / "new")  # no bench.json yet: one with the API rows
    assert set(json.loads((tmp_path / "new" / "bench.json").read_text())) >= {"config", "api"}


def test_the_compile_table_names_each_kernel_a_first_run_compiles(tmp_path):
    """The bench's first run in an empty kernel cache is recorded: a row per compiled
    kernel (the full pass of its dense matrix, the window's ring loop for a dense field
    and not its loop for component fields), its own seconds
    within its inclusive seconds, and Numba's passes summed; then the warm run."""
    from kvsim.tools.bench import end_to_end
    from kvsim.tools.bench.compile import lines

    (tmp_path / "s.toml").write_text(
        'name = "tiny"\nseeds = [0]\n[attention]\nsource = "seed_notebook"\nT = 48\n'
        'important = 4\nboost = 8.0\nnoise = 0.1\n[policies.window]\n'
        '[[experiment]]\nname = "e"\nprompt_len = 24\nbudgets = [8]\npolicies = ["window"]\n'
        'figures = []\n')
    result = end_to_end(tmp_path / "s.toml")
    assert result["cold"]["seconds"] > 0 and result["warm"]["peak_mb"] > 0
    kernels = result["compile"]["kernels"]
    assert {"kvsim.numerics.fullpass._dense_block", "kvsim.policies.ring.decode.dense"} <= \
        set(kernels)
    assert "kvsim.policies.ring.decode.components" not in kernels
    assert all(0 < r["self_s"] <= r["total_s"] and r["signatures"] >= 1 for r in kernels.values())
    assert result["compile"]["passes"]["native_lowering"] > 0
    assert "kvsim.policies.ring.decode.dense" in "\n".join(lines(result["compile"], len(kernels)))


def test_task_rows_on_the_tiny_model(tmp_path, monkeypatch):
    """``bench --tasks`` on a tiny Llama: the floor, kvsim's trial and their ratio, and
    kvpress's rows only where kvpress is importable."""
    import importlib.util

    pytest.importorskip("transformers")
    from kvsim.tools.bench.tasks import task_rows
    from test_task import tiny_task

    path = tiny_task(tmp_path, monkeypatch, 'lengths = [300]\ndepths = [0.0, 1.0]\n'
                     'budgets = [8, 12]\n[policies.window]\n[policies.h2o]\n')
    result = task_rows(path, length=300, prompts=2)
    assert result["runs_per_protocol"] == 4 and [r["depth"] for r in result["prompts"]] == [0.0, 1.0]
    for row in result["prompts"]:
        assert 0 < row["prefill_s"] < row["floor_s"] and row["kvsim_trial_s"] > 0
        assert row["trial_over_floor"] == row["kvsim_trial_s"] / row["floor_s"]
        assert row["kvsim_per_run_s"] == row["kvsim_trial_s"] / 8
        assert ("kvpress_per_run_s" in row) == (importlib.util.find_spec("kvpress") is not None)


def test_a_policy_rate_is_its_best_run(monkeypatch):
    """The policy rows take the least time of several runs: at least 3 after a warm-up, at
    most ``most``, until the time allowed is spent."""
    import kvsim.tools.bench as bench

    clock = iter([0.0, 5.0, 5.0, 6.0, 6.0, 9.0, 9.0, 9.5, 9.5, 13.0])  # runs of 5, 1, 3, 0.5, 3.5
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    calls = []
    assert bench._best(lambda: calls.append(1), seconds=12.0) == 0.5
    assert len(calls) == 6  # the warm-up, then 5 runs: 12 s spent after the fifth
    clock = iter(float(i) for i in range(100))
    assert bench._best(lambda: None, seconds=0.0, most=25) == 1.0  # the 3 it always takes
