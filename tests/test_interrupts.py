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
    "compile": lambda d: (d / ".r.lock").exists(),  # owned, a cold numba cache: compiling
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


def _interrupted():
    raise KeyboardInterrupt


def test_an_interrupt_that_a_callback_swallowed_still_stops_the_run(monkeypatch, capsys):
    """A signal landing in one of llvmlite's ctypes callbacks (Numba compiling in the main
    thread) was printed as an ignored exception, and the run went on to its report."""
    import ctypes

    from kvsim import cli

    def command(argv):
        ctypes.CFUNCTYPE(None)(_interrupted)()  # the handler's KeyboardInterrupt, swallowed
        for _ in range(500):  # the rest of the run
            time.sleep(0.01)
        return 0

    monkeypatch.setitem(cli.COMMANDS, "policies", command)
    assert cli.main(["policies"]) == 130
    assert capsys.readouterr().err == "kvsim: interrupted; no report written\n"


# A run of a few seconds: a field, three policies, no figures but the field's.
TINY = {"policies": {"window": {}, "h2o": {}, "tova": {}}, "seeds": [0, 1, 2, 3],
        "experiment.figures": [], "output.dpi": 30}


def test_signals_at_random_moments_leave_nothing_beside_the_report(tmp_path):
    """SIGINT (to the process group) and SIGTERM at seeded random moments of runs that
    own their report (a new one, or one replacing a report with --force), three at a
    time: each ends with its complete report or none, nothing else beside it, and no
    process of its group left behind."""
    import random
    import shutil

    rng = random.Random(37)
    runs = tmp_path / "runs"
    first = _start(runs / "first")
    assert first.wait(240) == 0, first.stderr.read()
    earlier = runs / "first" / "r"
    waiting = [(i, signal.SIGINT if i % 2 else signal.SIGTERM, rng.uniform(0, 4.0))
               for i in range(30)]
    running, ended, groups = [], [], []
    deadline = time.time() + 300
    try:
        while waiting or running:
            while waiting and len(running) < 3:
                i, sig, delay = waiting.pop(0)
                folder = runs / f"t{i}"
                folder.mkdir(parents=True)
                if i % 4 >= 2:  # a report of another file in place: replaced
                    shutil.copytree(earlier, folder / "r")
                running.append([_start(folder, "--force"), folder, sig, delay, None])
                groups.append(running[-1][0].pid)
            for run in list(running):
                proc, folder, sig, delay, due = run
                if due is None and (folder / ".r.lock").exists():  # the run owns its report
                    run[4] = due = time.time() + delay
                if due is not None and time.time() >= due and proc.poll() is None:
                    os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
                    run[4] = float("inf")
                if proc.poll() is not None:
                    stays = _group(proc.pid)
                    stdout, stderr = proc.communicate(timeout=30)
                    ended.append((folder, sig, proc.returncode, stdout, stderr, stays,
                                  sorted(p.name for p in folder.iterdir())))
                    running.remove(run)
                elif time.time() > deadline:
                    pytest.fail(f"{folder.name} stalled")
            time.sleep(0.005)
    finally:
        for group in groups:  # whatever a failed run left running
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for folder, sig, status, stdout, stderr, stays, left in ended:
        what = (folder.name, sig.name, status, stderr[-300:], stays, left)
        assert status in (0, 130) and not stays, what
        if status == 130:
            assert (stdout, stderr) == ("", "kvsim: interrupted; no report written\n"), what
        assert left in (["r", "s.toml"], ["s.toml"]), what  # no .r.units, .r.tmp-*, .r.lock
        if "r" in left:
            assert (folder / "r" / "report.md").is_file(), what
        else:
            assert int(folder.name[1:]) % 4 < 2, what  # a report in place is never lost
    assert 130 in {status for _, _, status, *_ in ended}


def _start(folder: Path, *extra: str) -> subprocess.Popen:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "s.toml").write_text(to_toml(document("field", TINY)))
    return subprocess.Popen([sys.executable, "-m", "kvsim", str(folder / "s.toml"), "--out",
                             str(folder / "r"), "--quiet", "--workers", "2", *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)


def _group(group: int, wait: float = 6.0) -> list[int]:
    """The live processes of process group ``group`` still there after ``wait`` seconds
    (a run's terminated workers take a moment to go)."""
    end = time.time() + wait
    while True:
        alive = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                state, _, pgrp = stat.read_text().rsplit(")", 1)[1].split()[:3]
            except (OSError, IndexError):
                continue
            if int(pgrp) == group and state != "Z":
                alive.append(int(stat.parent.name))
        if not alive or time.time() > end:
            return alive
        time.sleep(0.05)
