"""Report folders are owned: one run per target, leftovers of killed runs cleaned or
reused, SIGTERM handled like SIGINT, SIGKILL + --resume gives the same results.csv."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broken import cli, document, to_toml
from kvsim.report.lock import ReportLock

ROOT = Path(__file__).parents[1]
# Long enough (several seconds of runs) to be stopped midway.
SMALL = {"policies": {"window": {}, "h2o": {}}, "experiment.figures": []}
SLOW = {**SMALL, "seeds": list(range(10)), "attention.T": 512, "attention.heads": 2,
        "experiment.prompt_len": 256, "experiment.budgets": [64, 128]}


def _scenario(tmp_path: Path, patch=None) -> Path:
    path = tmp_path / "s.toml"
    path.write_text(to_toml(document("field", patch or SMALL)))
    return path


def _start(path: Path, out: Path, *extra) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "kvsim", str(path), "--out", str(out),
                             "--quiet", "--workers", "1", *extra], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_units(proc: subprocess.Popen, units: Path, count: int) -> None:
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if units.is_dir() and len(list(units.glob("*.npz"))) >= count:
            return
        time.sleep(0.02)
    pytest.fail(f"the run ended or stalled before storing {count} units: {proc.poll()}")


def test_a_second_run_on_the_same_target_exits_2_naming_the_first(tmp_path):
    path = _scenario(tmp_path)
    out = tmp_path / "r"
    with ReportLock(out):
        status, stdout, stderr = cli([path, "--out", out, "--quiet"])
        assert status == 2 and stdout == ""
        assert stderr.strip() == (f"kvsim: {out}: expected no other kvsim run on this "
                                  f"report, but process {os.getpid()} is writing it")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.toml"]


def test_leftovers_of_dead_runs_are_cleaned(tmp_path):
    path = _scenario(tmp_path)
    out = tmp_path / "r"
    for name in (".r.tmp-99999999", ".r.units"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "x").write_text("left by a killed run")
    (tmp_path / ".r.lock").write_text("99999999\n")  # its flock died with it
    assert cli([path, "--out", out, "--quiet", "--workers", "1"])[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "s.toml"]
    assert (out / "results.csv").exists()


def test_a_report_moved_aside_by_a_killed_replace_is_put_back(tmp_path):
    path = _scenario(tmp_path)
    out = tmp_path / "r"
    (tmp_path / ".r.old-99999999").mkdir()
    (tmp_path / ".r.old-99999999" / "results.csv").write_text("the previous report")
    status, _, stderr = cli([path, "--out", out, "--quiet"])
    assert status == 2 and "expected a new folder or a report kvsim wrote" in stderr
    assert (out / "results.csv").read_text() == "the previous report"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "s.toml"]


def test_sigkill_then_resume_gives_identical_results(tmp_path):
    path = _scenario(tmp_path, SLOW)
    reference = tmp_path / "reference"
    assert cli([path, "--out", reference, "--quiet", "--workers", "1"])[0] == 0
    out = tmp_path / "r"
    proc = _start(path, out)
    _wait_for_units(proc, tmp_path / ".r.units", 4)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    stored = len(list((tmp_path / ".r.units").glob("*.npz")))
    proc = _start(path, out, "--resume")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert (out / "results.csv").read_bytes() == (reference / "results.csv").read_bytes()
    assert stored >= 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "reference", "s.toml"]


def test_sigterm_and_sighup_stop_like_sigint(tmp_path):
    path = _scenario(tmp_path, SLOW)
    procs = {sig: _start(path, tmp_path / name, *extra) for sig, name, extra in
             ((signal.SIGTERM, "a", ["--resume"]), (signal.SIGHUP, "b", []))}
    for (sig, proc), name in zip(procs.items(), "ab"):
        _wait_for_units(proc, tmp_path / f".{name}.units", 1)
        proc.send_signal(sig)
    for proc, name in zip(procs.values(), "ab"):
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 130 and stdout == ""
        assert stderr.strip().startswith("kvsim: interrupted")
        assert len(stderr.strip().splitlines()) == 1
        assert (f"kept in {tmp_path / '.a.units'}" in stderr) == (name == "a")
    # Only the finished units of the run started with --resume stay; no lock, no
    # temporary folder.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.units", "s.toml"]


def test_a_signal_held_while_the_lock_is_taken_leaves_no_lock_file(tmp_path, monkeypatch):
    """Ctrl-C or SIGTERM while the lock is being taken is held until the lock file exists
    and is owned, then arrives inside ``__enter__``, where no ``__exit__`` follows: the lock
    must be given back there (test_interrupts met a ``.r.lock`` left behind)."""
    lock = ReportLock(tmp_path / "r")
    take = lock._take

    def interrupted_take():
        take()
        raise KeyboardInterrupt  # as the held signal, delivered when the block ends

    monkeypatch.setattr(lock, "_take", interrupted_take)
    with pytest.raises(KeyboardInterrupt):
        lock.__enter__()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    with ReportLock(tmp_path / "r"):  # free for the next run
        pass
