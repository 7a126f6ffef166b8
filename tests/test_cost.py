"""Cost before work: the estimate, the key named when a run is refused, and the progress
of a long full pass (which must not change a single bit)."""

from __future__ import annotations

import numpy as np
import pytest

from broken import cli, document, to_toml
from kvsim.attention import components
from kvsim.engine import cost
from kvsim.engine.experiments import count_runs
from kvsim.numerics import fullpass
from kvsim.resources import parse_size
from kvsim.scenario.load import load_sweep


def _variants(tmp_path, patch=None):
    path = tmp_path / "s.toml"
    path.write_text(to_toml(document("field", patch)))
    return load_sweep(path)


def test_estimate_counts_runs_and_logits(tmp_path):
    variants = _variants(tmp_path)
    estimate = cost.estimate(variants, workers=1)
    assert estimate.runs == sum(count_runs(v) for v in variants)
    assert estimate.units == 4 * 2 * 1  # policies x seeds x KV heads
    # Two seeds x two heads x one prompt length x T (T + 1) / 2, plus the decode steps.
    full = 2 * 2 * 48 * 49 / 2
    decode = 2 * 4 * 24 * (8 + 12) * 2
    assert estimate.logits == full + decode
    assert 0 < estimate.peak_bytes < 2**30


@pytest.mark.parametrize("patch, key", [
    ({"attention.T": 3_000_000}, "attention.T"),
    ({"attention.heads": 4000, "attention.T": 8192, "experiment.prompt_len": 4096,
      "experiment.budgets": [64]}, "attention.heads"),
    ({"seeds": list(range(5000)), "attention.T": 8192, "experiment.prompt_len": 4096,
      "experiment.budgets": [64]}, "seeds"),
    ({"attention.qk.dim": 60_000, "attention.T": 16384, "experiment.prompt_len": 8192,
      "experiment.budgets": [64]}, "attention.qk.dim"),
])
def test_a_refused_run_names_the_key_that_drives_its_cost(tmp_path, patch, key):
    variants = _variants(tmp_path, patch)
    assert cost.estimate(variants, workers=2).driver == key
    path = tmp_path / "s.toml"
    status, out, err = cli(["validate", path, "--max-memory", "1G"])
    assert status == 2 and err.startswith(f"{path.resolve()}: {key}: expected the run to fit")


def test_validate_prints_the_cost_in_one_line(tmp_path):
    _variants(tmp_path)
    status, out, err = cli(["validate", tmp_path / "s.toml"])
    assert status == 0 and err == ""
    (line,) = out.strip().splitlines()
    assert "ok (1 field variant(s)" in line and "cost: 8 units (32 runs), " in line
    assert "logit evaluations, peak memory about" in line


def test_sizes():
    assert parse_size("4G") == 4 * 2**30 and parse_size("512m") == 512 * 2**20
    assert parse_size("1.5K") == 1536 and parse_size("100") == 100


def test_long_full_pass_shows_rows_and_gives_the_same_numbers(monkeypatch, capsys):
    heads = [{"recency": {"kind": "power", "alpha": 0.7, "tau": 1.0},
              "noise": {"kind": "gaussian", "scale": 1.0},
              "qk": {"dim": 4, "clusters": 3, "spread": 0.5, "focus": 2, "strength": 1.0,
                     "values": True}, "boost": []}]
    field, _ = components.build(heads, 700, 1, seed=3)
    quiet = fullpass.full_pass(field, 0, 300)
    monkeypatch.setattr(fullpass, "LONG_PASS", 0)
    shown = fullpass.full_pass(field, 0, 300, progress=True)
    assert "full pass, head 0" in capsys.readouterr().err
    for a, b in zip(quiet, shown):
        np.testing.assert_array_equal(a, b)


def test_long_full_pass_counts_logits_so_that_its_eta_is_linear(monkeypatch):
    counted = []

    class Bar:  # records what the pass reports
        def __init__(self, total, **kwargs):
            counted.append(total)

        def update(self, n):
            counted.append(n)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False
    field, _ = components.build([{"recency": {"kind": "power", "alpha": 0.7, "tau": 1.0},
                                  "boost": []}], 700, 1, seed=3)
    monkeypatch.setattr(fullpass, "LONG_PASS", 0)
    monkeypatch.setattr(fullpass, "tqdm", Bar)
    fullpass.full_pass(field, 0, 300, progress=True)
    total, *updates = counted
    assert total == sum(updates) == 700 * 701 // 2  # every logit of the causal pass
    assert len(updates) > 16  # in steps, not at the end


def test_max_memory_lasts_for_one_command(tmp_path):
    from kvsim import resources

    _variants(tmp_path)
    assert cli(["validate", tmp_path / "s.toml", "--max-memory", "1K"])[0] == 2
    assert resources._limit is None  # the next run, in this process, has the machine's


def test_an_interrupted_long_pass_stops_within_a_span(monkeypatch):
    import signal
    import time

    field, _ = components.build([{"recency": {"kind": "power", "alpha": 0.7, "tau": 1.0},
                                  "boost": []}], 700, 1, seed=3)
    fullpass.full_pass(field, 0, 300)  # compiled before the clock matters
    monkeypatch.setattr(fullpass, "LONG_PASS", 0)  # spans of 16 rows: 44 per block
    monkeypatch.setattr(fullpass, "SERIAL_ENTRIES", 0)  # on threads where there are two
    calls = []
    real = fullpass._full_pass_block

    def span(*args):
        calls.append(1)
        if len(calls) == 3:
            signal.raise_signal(signal.SIGINT)  # Ctrl-C: the main thread gets it
        time.sleep(0.002)
        return real(*args)
    monkeypatch.setattr(fullpass, "_full_pass_block", span)
    with pytest.raises(KeyboardInterrupt):
        fullpass.full_pass(field, 0, 300)
    assert len(calls) < 16 * 44 // 4  # stopped, not run to the end



def test_a_dense_field_compiles_no_logit_code(tmp_path):
    """The full pass and row sums of a dense matrix run kernels of their own: in an empty
    kernel cache they compile none of the component field's logit code (seconds of a
    first run), and give the numbers of a dense field read row by row."""
    import os
    import subprocess
    import sys

    code = """
import numpy as np
from kvsim.numerics import field, fullpass, kernels
A = np.tril(np.random.default_rng(0).random((1, 40, 40)))
A /= A.sum(axis=2, keepdims=True)
f = field.dense_field(A)
p = fullpass.full_pass(f, 0, 16)
rows = kernels.row_sums(f, p.row_max[None], p.row_sum[None], 0, 3, 30)
np.save(r"%s", np.concatenate([p.prompt_colsum, p.decode_colsum, p.decode_mass, rows]))
print(len(fullpass.row_exp.signatures), len(field.logits_row.signatures))
""" % (tmp_path / "out.npy")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout.split()
    assert out == ["0", "0"]
    A = np.tril(np.random.default_rng(0).random((1, 40, 40)))
    A /= A.sum(axis=2, keepdims=True)
    got = np.load(tmp_path / "out.npy")
    want_rows = np.zeros(40)
    for q in range(3, 30):
        want_rows[:q + 1] += A[0, q, :q + 1]
    assert np.array_equal(got[104:], want_rows)  # summed row by row, in order
    assert np.allclose(got[:40] + got[40:80], A[0].sum(axis=0), rtol=0, atol=1e-12)
    assert np.allclose(got[80:104], A[0, 16:].sum(axis=1), rtol=0, atol=1e-12)
