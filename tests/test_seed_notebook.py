"""The seed notebook's scenario, reproduced exactly (matrix, kept sets, recalls)."""

import numpy as np
import pytest

import kvsim
from kvsim.attention.seed_notebook import planted_matrix

T, BUDGET = 512, 64


@pytest.fixture(scope="module")
def notebook():
    """The notebook's own construction, loop for loop, and its three selections."""
    rng = np.random.default_rng(0)
    important = sorted(rng.choice(T, size=32, replace=False).tolist())
    A = np.zeros((T, T), dtype=np.float32)
    for q in range(T):
        for k in range(q + 1):
            A[q, k] = 1.0
        for k in important:
            if k <= q:
                A[q, k] += 8.0
    A += rng.exponential(0.1, size=A.shape) * np.tri(T, T)
    A = A / (A.sum(axis=1, keepdims=True) + 1e-12)
    kept = {
        "streaming_llm": set(range(4)) | set(range(T - (BUDGET - 4), T)),
        "h2o_offline": set(np.argsort(-A.sum(axis=0))[:BUDGET].tolist()),
        "snapkv": set(np.argsort(-A[-32:].sum(axis=0))[:BUDGET].tolist()),
    }
    return A, important, kept


def test_matrix_is_bit_identical(notebook):
    A, important, _ = notebook
    ours, positions = planted_matrix(T, 32, 8.0, 0.1, 0)
    assert ours.dtype == np.float32
    assert np.array_equal(ours, A)
    assert positions.tolist() == important


@pytest.mark.parametrize("policy, params, recall", [
    ("streaming_llm", {"sinks": 4}, 0.125),
    ("h2o_offline", {"recent_ratio": 0.0}, 0.71875),
    ("snapkv", {"window": 32, "pooling": "none", "protect_window": False}, 1.0),
])
def test_kept_sets_and_recall(notebook, policy, params, recall):
    A, important, kept = notebook
    result = kvsim.simulate(A, policy, BUDGET, T, important=important, **params)
    assert set(result.kept.tolist()) == kept[policy]
    assert len(result.kept) == BUDGET
    assert result.final_recall == recall
    assert result.mass.size == 0


def test_scenario_file_reproduces_notebook(tmp_path):
    out = kvsim.run("scenarios/seed_notebook.toml", tmp_path / "nb")
    import csv
    rows = [r for r in csv.DictReader(open(out / "results.csv")) if r["experiment"] == "notebook"]
    assert {r["policy"]: float(r["final_recall"]) for r in rows} == {
        "streaming_llm": 0.125, "h2o_offline": 0.71875, "snapkv": 1.0}
    assert (out / "notebook_pareto.png").stat().st_size > 10_000
    assert (out / "budget_sweep_recall_vs_budget.png").exists()
    steps = np.load(out / "steps.npz")
    kept = steps["notebook/kept"]
    assert kept.shape == (3, BUDGET)
    assert steps["decode/mass"].shape == (7 * 3, T - 64)
