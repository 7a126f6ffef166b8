"""Presses as task policies without kvpress installed: budgets become the compression_ratio
that keeps exactly B keys (kvpress's ``compute_n_kept`` rounding, restated), and a press
table without the extra is one line saying how to install it (tests/test_kvpress.py runs
the presses themselves where the extra is installed)."""

from __future__ import annotations

import importlib.util

import pytest

from kvsim.errors import ScenarioError
from kvsim.tools.task.config import load_config
from kvsim.tools.study.presses import n_kept, ratio

TASK = """name = "t"
[task]
lengths = [128]
depths = [0.5]
budgets = [16]
compress = ["prefill_only"]
[policies.snap]
press = "SnapKVPress"
window_size = 8
"""


def test_ratio_keeps_exactly_the_budget():
    for k_len in (5, 17, 100, 122, 999, 1000, 1001, 4096, 32768, 131071):
        for b in {1, 2, k_len // 3, k_len // 2, k_len - 2, k_len - 1}:
            if 1 <= b < k_len:
                r = ratio(k_len, b)
                assert 0 <= r < 1 and n_kept(k_len, r) == b, (k_len, b)
    assert ratio(10, 10) == ratio(10, 12) == 0.0  # the whole context fits


def test_a_press_without_the_extra_is_one_line_saying_how_to_install(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "kvpress" else real(name, *a))
    (tmp_path / "t.toml").write_text(TASK)
    with pytest.raises(ScenarioError) as info:
        load_config(tmp_path / "t.toml")
    (line,) = str(info.value).splitlines()
    assert "policies.snap.press" in line and 'pip install -e ".[capture,kvpress]"' in line


@pytest.mark.parametrize("version", ["5.25.0", "5.1.0", None])
def test_a_transformers_outside_kvpress_pin_is_one_line_before_kvpress_imports(
        tmp_path, monkeypatch, version):
    """kvpress 0.5.5 pins transformers<5.3 (the shared interpreter has 5.25, CI's kvpress
    venv 5.2): the version is read from transformers' metadata, and a task file naming a
    press is refused in one line saying how to install the extra, kvpress never imported."""
    from importlib import metadata

    from kvsim.tools.study import presses

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: real("json")
                        if name == "kvpress" else real(name, *a))  # "installed"

    def fake_version(name):
        if name != "transformers":
            return metadata.version(name)
        if version is None:
            raise metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(presses.metadata, "version", fake_version)
    monkeypatch.setitem(__import__("sys").modules, "kvpress", None)  # importing it fails
    (tmp_path / "t.toml").write_text(TASK)
    with pytest.raises(ScenarioError) as info:
        load_config(tmp_path / "t.toml")
    (line,) = str(info.value).splitlines()
    assert line == (f"{tmp_path / 't.toml'}: policies.snap.press: expected transformers"
                    f">=5.2,<5.3 for kvpress, got {version or 'none'}: pip install -e "
                    f'".[capture,kvpress]" in a venv of its own (kvpress 0.5.5 pins '
                    f"transformers<5.3; see docs/tasks.md)")


def test_the_transformers_pin_is_the_kvpress_extras():
    import tomllib

    from kvsim.tools.study.presses import TRANSFORMERS

    root = __import__("pathlib").Path(__file__).parents[1]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["kvpress"]
    assert f"transformers{TRANSFORMERS}" in extra


def test_kvsim_task_without_the_extra_exits_2_in_one_line_and_writes_nothing(tmp_path):
    """The command, in a process of its own where kvpress cannot be found: exit 2, one line
    naming the file and the key, no traceback, no report folder, torch never imported."""
    import subprocess
    import sys

    (tmp_path / "t.toml").write_text(TASK)
    code = ("import importlib.util, sys\nreal = importlib.util.find_spec\n"
            "importlib.util.find_spec = lambda n, *a: None if n == 'kvpress' else real(n, *a)\n"
            "from kvsim.cli import main\nstatus = main(sys.argv[1:])\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nsys.exit(status)")
    for command in (["task", "t.toml"], ["validate", "t.toml"]):
        done = subprocess.run([sys.executable, "-c", code, *command], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert (done.returncode, done.stdout) == (2, ""), done.stderr
        (line,) = done.stderr.splitlines()
        assert line.startswith("t.toml: policies.snap.press: expected the kvpress extra: pip "
                               'install -e ".[capture,kvpress]" in a venv of its own'), line
        assert sorted(p.name for p in tmp_path.iterdir()) == ["t.toml"]


def test_one_worker_with_a_progress_bar_runs_every_trial(monkeypatch, capsys):
    """``kvsim task`` without --quiet on one worker: the bar's update returned True when it
    redrew, which the trial loop took for a trial's rows ("'bool' object is not iterable")."""
    import dataclasses
    import time
    from pathlib import Path

    from kvsim.tools.task import command
    from kvsim.tools.task.config import TaskConfig

    pytest.importorskip("torch")
    cfg = TaskConfig(Path("t.toml"), "t", "", Path("."), None, (128, 256), (0.0, 1.0), 2, 0,
                     (16,), 16, ("prefill_only",), "seeded", "raw", 8, "mean", 100, (),
                     ("png",), 60)
    monkeypatch.setattr(command, "prompt_frame", lambda cfg, tokenizer: None)
    monkeypatch.setattr(command, "_trial",  # as slow as tqdm's redraw interval (0.1 s)
                        lambda i: time.sleep(0.11) or [{"trial": i}])
    monkeypatch.setattr("kvsim.models.adapter.attach", lambda net: None)
    rows = command.run_all(dataclasses.replace(cfg), object(), None, 1, progress=True)
    assert rows == [{"trial": i} for i in range(8)]


def test_wilson_interval_holds_its_proportion_exactly_at_the_ends():
    """At 0 or n successes rounding left an end a hair inside (wilson(10, 10) ended at
    0.9999999999999999), and the report's error bars refused the negative length."""
    from kvsim.tools.task.report import wilson

    for n in range(1, 200):
        for k in range(n + 1):
            lo, hi = wilson(k, n)
            assert lo <= k / n <= hi
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0
