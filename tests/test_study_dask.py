"""``kvsim task`` and ``kvsim closed-loop`` with ``--dask``: on a LocalCluster of 2 processes
the report's files are the bytes of a local run, each worker loads the model once (not once
per trial), and a bad address or a missing ``distributed`` is one line, exit 2, before
anything is written."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from kvsim.cli import main

distributed = pytest.importorskip("dask.distributed")
pytest.importorskip("transformers")

from test_task import CharTokenizer, tiny_net  # noqa: E402


def tiny_model(model: str, gguf_file=None):
    """``load_model`` of the tiny Llama saved as ``model``: notes this process's id in the
    file ``loads`` beside it (a Dask worker imports this module to call it)."""
    with open(Path(model).parent / "loads", "a") as f:
        f.write(f"{os.getpid()}\n")
    return tiny_net(512), CharTokenizer()


@pytest.fixture(scope="module")
def cluster():
    """Two single-threaded worker processes (started once for the module)."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=":0") as c:
        yield c


TASK = ('name = "tiny"\n[task]\nmodel = "m"\nlengths = [300]\ndepths = [0.0, 1.0]\n'
        'trials = 2\nbudgets = [8, 12]\n[policies.window]\n[policies.h2o]\n')
CLOSED_LOOP = ('name = "tiny"\n[closed_loop]\nmodel = "m"\ntext = "text.txt"\ntokens = 48\n'
               'prompt_len = 32\nbudgets = [8, 16]\nbatch = 2\n[policies.window]\n'
               '[policies.h2o]\n')


def study_file(tmp_path: Path, monkeypatch, body: str) -> Path:
    """``tmp_path/s.toml`` of the tiny Llama (saved as ``m``, loaded by :func:`tiny_model`)."""
    import kvsim.models.capture
    from kvsim.tools.closed_loop import command

    monkeypatch.setattr(kvsim.models.capture, "load_model", tiny_model)
    monkeypatch.setattr(command, "load_model", tiny_model)
    tiny_net(512).save_pretrained(tmp_path / "m")
    (tmp_path / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 4)
    (tmp_path / "s.toml").write_text(body)
    return tmp_path / "s.toml"


RUN = ("- command:", "- kvsim ", "- wall time", "- Wall time")  # report.md's lines on the run itself


def same_files(local: Path, dask: Path, facts: str) -> None:
    """Every file of the two reports is the same bytes, apart from the run's facts (wall
    time, date, load, workers) in ``facts`` and report.md's lines on the run."""
    files = sorted(p.name for p in local.iterdir())
    assert files == sorted(p.name for p in dask.iterdir())
    assert "results.csv" in files
    for name in files:
        a, b = (local / name).read_bytes(), (dask / name).read_bytes()
        if name == facts:
            a, b = json.loads(a), json.loads(b)
            a, b = a["settings"], b["settings"]
        elif name == "report.md":
            a, b = ([line for line in text.decode().splitlines() if not line.startswith(RUN)]
                    for text in (a, b))
        assert a == b, name


def finished_bars(err: str) -> set:
    """The progress bars that reached their end in ``err``: (description, total)."""
    bars = {(desc.strip(), int(done), int(total)) for desc, done, total in
            re.findall(r"([^\r\n|]+): 100%\|[^|]*\| (\d+)/(\d+)", err)}
    assert bars and all(done == total for _, done, total in bars), err
    return bars


@pytest.mark.parametrize("command, body, facts", [
    ("task", TASK, "task.json"), ("closed-loop", CLOSED_LOOP, "closed_loop.json")])
def test_a_study_on_a_local_cluster_equals_the_local_run(tmp_path, monkeypatch, cluster,
                                                        capsys, command, body, facts):
    path = study_file(tmp_path, monkeypatch, body)
    capsys.readouterr()
    assert main([command, str(path), "--out", str(tmp_path / "local")]) == 0  # in-process:
    # a fork of this process, which hosts the cluster's scheduler, is no local run
    local = finished_bars(capsys.readouterr().err)
    loads = tmp_path / "loads"
    loads.unlink()
    assert main([command, str(path), "--out", str(tmp_path / "dask"),
                 "--dask", cluster.scheduler_address]) == 0
    assert finished_bars(capsys.readouterr().err) == local  # the progress of a local run
    same_files(tmp_path / "local", tmp_path / "dask", facts)
    pids = loads.read_text().split()
    assert len(pids) == len(set(pids)) <= 3  # once in this process, once per worker at most
    assert os.getpid() in map(int, pids)
    saved = json.loads((tmp_path / "dask" / facts).read_text())
    run = saved.get("facts", saved)
    assert run["dask"] == cluster.scheduler_address and run["workers"] == 2
    assert f"2 worker processes of the Dask cluster {cluster.scheduler_address}" in \
        (tmp_path / "dask" / "report.md").read_text()


def test_each_worker_loads_the_model_once_for_every_trial(tmp_path, monkeypatch, cluster):
    from kvsim.tools.task.command import task_report

    path = study_file(tmp_path, monkeypatch, TASK.replace("trials = 2", "trials = 3"))
    task_report(path, tmp_path / "r", progress=False, dask=cluster.scheduler_address)
    pids = (tmp_path / "loads").read_text().split()
    assert len(pids) == len(set(pids)) <= 3 < 2 * 3  # 6 trials, loaded at most 3 times


def test_the_gate_on_a_cluster_prints_the_local_table(tmp_path, monkeypatch, cluster, capsys):
    path = study_file(tmp_path, monkeypatch, TASK)
    assert main(["task", str(path), "--gate", "--quiet"]) == 0
    local = capsys.readouterr().out
    assert main(["task", str(path), "--gate", "--quiet", "--dask",
                 cluster.scheduler_address]) == 0
    assert capsys.readouterr().out == local and "full cache's answers per cell" in local


def test_jobs_on_a_cluster_tick_the_bar_as_they_run(cluster):
    from kvsim.tools.study.cluster import on_cluster
    from kvsim.tools.study.workers import study_map
    from test_study_types import Bar, ticking

    bar = Bar()
    with on_cluster(cluster.scheduler_address):
        assert study_map(ticking, [(3, 1.0), (4, 1.0)], 1, (), bar, lambda item: item[0]) \
            == [30, 40]
    assert sum(bar.updates) == 7 and len(bar.updates) > 2  # tick by tick, not job by job


@pytest.mark.parametrize("address, message", [
    ("nowhere", "kvsim: --dask: expected a scheduler address tcp://HOST:PORT (port 1 to "
                "65535) or local:N, got 'nowhere'"),
    ("tcp://127.0.0.1:9", "kvsim: --dask tcp://127.0.0.1:9: expected a reachable Dask "
                          "scheduler")])
@pytest.mark.parametrize("command, body", [("task", TASK), ("closed-loop", CLOSED_LOOP)])
def test_a_bad_address_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, command,
                                                      body, address, message):
    path = study_file(tmp_path, monkeypatch, body)
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([command, str(path), "--out", str(tmp_path / "r"), "--dask", address]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith(message), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no report, no lock, no load


def test_without_distributed_it_is_one_line(tmp_path, monkeypatch, capsys):
    import builtins

    path = study_file(tmp_path, monkeypatch, TASK)
    real = builtins.__import__

    def no_dask(name, *args, **kwargs):
        if name.startswith(("dask", "distributed")):
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_dask)
    capsys.readouterr()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["task", str(path), "--dask", "local:2"]) == 2
    assert capsys.readouterr().err == ("kvsim: --dask: expected dask.distributed to be "
                                       "installed: the distributed extra (pip install -e "
                                       "\".[distributed]\")\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("flags, message", [
    (["--workers", "2"], "kvsim: --dask: expected no --workers with it (the cluster's worker "
                         "processes run the study)\n"),
    (["--redraw"], "kvsim: --dask: expected no --redraw with it (a redraw runs no model)\n")])
def test_dask_excludes_workers_and_redraw(tmp_path, monkeypatch, capsys, flags, message):
    path = study_file(tmp_path, monkeypatch, TASK)
    capsys.readouterr()
    assert main(["task", str(path), "--dask", "local:2", *flags]) == 2
    assert capsys.readouterr().err == message
