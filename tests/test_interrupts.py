"""Ctrl-C (SIGINT to the process group) and SIGTERM at every phase of a run, in real
processes: one line on stderr, exit status 130, no traceback, nothing left on disk
unless the run was started with --resume."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from broken import document, to_toml
from kvsim.policies import Trace

ROOT = Path(__file__).parents[1]
# Several seconds of runs, then a few dozen figures on two processes.
SLOW = {"policies": {"window": {}, "h2o": {}, "tova": {}}, "seeds": list(range(6)),
        "attention.T": 512, "attention.heads": 2, "experiment.prompt_len": 256,
        "experiment.budgets": [32, 64, 128]}


def _first(tmp_path: Path, pattern: str):
    return next(iter(sorted(tmp_path.glob(pattern))), None)


PHASES = {  # phase: when it has begun (tmp_path -> bool)
    "compile": lambda d: (d / ".r.units").is_dir(),  # a cold numba cache: first kernels
    "simulate": lambda d: _first(d, ".r.units/*.npz") is not None,
    "write": lambda d: _first(d, ".r.tmp-*/results.csv") is not None,
    "figures": lambda d: _first(d, ".r.tmp-*/*.png") is not None,
}


def _interrupt(tmp_path: Path, phase: str, sig: signal.Signals, *extra, env=None):
    path = tmp_path / "s.toml"
    path.write_text(to_toml(document("field", SLOW)))
    proc = subprocess.Popen([sys.executable, "-m", "kvsim", str(path), "--out",
                             str(tmp_path / "r"), "--quiet", "--workers", "2", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, **(env or {})})
    deadline = time.time() + 240
    while not PHASES[phase](tmp_path):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail(f"the run ended or stalled before its {phase} phase: "
                        f"{proc.communicate()[1][-2000:]}")
        time.sleep(0.005)
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)  # what Ctrl-C does: the whole process group
    else:
        proc.send_signal(sig)
    started = time.time()
    stdout, stderr = proc.communicate(timeout=60)
    return proc.returncode, stdout, stderr, time.time() - started


@pytest.mark.parametrize("phase", ["compile", "simulate", "write", "figures"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupt_at_each_phase(tmp_path, phase, sig):
    env = {"NUMBA_CACHE_DIR": str(tmp_path / "cache")} if phase == "compile" else None
    status, stdout, stderr, took = _interrupt(tmp_path, phase, sig, env=env)
    if status == 0 and phase != "compile":
        pytest.skip(f"the run finished before the signal arrived ({phase})")
    assert (status, stdout, stderr) == (130, "", "kvsim: interrupted; no report written\n")
    assert took < 30
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == (["cache", "s.toml"] if phase == "compile" else ["s.toml"])
    time.sleep(0.5)  # terminated workers are gone, not writing
    assert sorted(p.name for p in tmp_path.iterdir()) == left


def test_interrupt_keeps_the_units_of_a_run_started_with_resume(tmp_path):
    status, stdout, stderr, _ = _interrupt(tmp_path, "simulate", signal.SIGINT, "--resume")
    units = tmp_path / ".r.units"
    assert status == 130 and stdout == ""
    assert stderr == (f"kvsim: interrupted; no report written; the finished units are kept "
                      f"in {units}: run the same command again to reuse them\n")
    assert units.is_dir() and sorted(p.name for p in tmp_path.iterdir()) == [".r.units", "s.toml"]


def test_a_closed_unit_store_saves_nothing_and_its_removal_waits_for_a_save(tmp_path,
                                                                         monkeypatch):
    """A policy thread that finishes after the run was interrupted must not recreate the
    folder the run removed (a race CI met once: ``.r.units`` left after SIGTERM)."""
    import threading

    import numpy as np

    from kvsim.engine.resume import UnitStore

    trace = Trace(*(np.arange(3.0),) * 6)
    store = UnitStore(tmp_path / ".r.units", resume=False)
    store.save("a", [trace])
    saving = threading.Event()
    real_savez = np.savez

    def slow_savez(*args, **kwargs):  # the close arrives while this save is writing
        saving.set()
        time.sleep(0.3)
        real_savez(*args, **kwargs)

    monkeypatch.setattr(np, "savez", slow_savez)
    late = threading.Thread(target=store.save, args=("b", [trace]))
    late.start()
    saving.wait(5)
    store.close(keep=False)
    late.join()
    monkeypatch.undo()
    store.save("c", [trace])
    assert not store.folder.exists()

    kept = UnitStore(tmp_path / ".k.units", resume=True)
    kept.save("a", [trace])
    kept.close(keep=True)
    kept.save("b", [trace])
    assert sorted(p.name for p in kept.folder.iterdir()) == ["a.npz"]
