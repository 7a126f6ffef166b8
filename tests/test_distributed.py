"""Dask: a LocalCluster of 2 processes gives the bytes of a local run, survives a killed
worker, resumes after a lost client; trace globs; an unreachable scheduler is exit 2."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import kvsim
from kvsim.cli import main
from kvsim.engine import distributed
from kvsim.engine.resume import UnitStore

distributed_dask = pytest.importorskip("dask.distributed")

SCENARIO = """\
name = "spread"
seeds = [0, 1]

[attention]
source = "field"
T = 320
heads = 4
kv_heads = 2

[attention.sinks]
count = 4
strength = 5.0
[attention.heavy_hitters]
count = 12
strength = 4.0
[attention.noise]
scale = 0.5

[policies.h2o]
[policies.snapkv]
window = 16
[policies.tova]
[policies.oracle]
[policies.random]
[policies.full]

[sweep]
"attention.noise.scale" = [0.5, 1.0]

[[experiment]]
name = "decode"
prompt_len = 200
budgets = [24, 48]
figures = ["mass_vs_budget"]

[[experiment]]
name = "prefill"
prompt_len = 320
budgets = [32]
figures = []

[output]
formats = ["png"]
dpi = 40
"""


@pytest.fixture(scope="module")
def cluster():
    """Two single-threaded worker processes (started once for the module)."""
    with distributed_dask.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=":0") as c:
        yield c


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "spread.toml"
    p.write_text(SCENARIO)
    return p


def same_report(a, b) -> None:
    for name in ("results.csv", "steps.npz"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_local_cluster_of_two_processes_gives_the_local_bytes(path, tmp_path, cluster):
    local = kvsim.run(path, tmp_path / "local", workers=2)  # also warms the Numba cache
    remote = kvsim.run(path, tmp_path / "remote", dask=cluster.scheduler_address)
    same_report(local, remote)
    assert not (tmp_path / ".remote.units").exists()


def test_cli_dask_local_n(path, tmp_path, capsys):
    local = kvsim.run(path, tmp_path / "local", workers=1)
    out = tmp_path / "cli"
    assert main([str(path), "--out", str(out), "--quiet", "--dask", "local:1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    same_report(local, out)


def test_killed_worker_reruns_its_units_elsewhere(path, tmp_path, cluster):
    path.write_text(SCENARIO.replace("T = 320", "T = 2400").replace("prompt_len = 200",
                                                                     "prompt_len = 1200")
                    .replace("prompt_len = 320", "prompt_len = 2400"))
    local = kvsim.run(path, tmp_path / "local", workers=2)
    with distributed_dask.Client(cluster.scheduler_address) as client:
        pids = client.run(os.getpid)
        done: dict = {}
        runner = threading.Thread(target=lambda: done.setdefault(
            "out", kvsim.run(path, tmp_path / "remote", dask=cluster.scheduler_address)))
        runner.start()
        victim = None
        while victim is None and runner.is_alive():
            busy = {w: tasks for w, tasks in client.processing().items()
                    if any(str(t).startswith("kvsim-") for t in tasks)}
            victim = next(iter(busy), None)
            time.sleep(0.02)
        assert victim is not None, "the run ended before any task was seen processing"
        os.kill(pids[victim], signal.SIGKILL)  # its nanny starts a fresh worker
        runner.join()
    assert "out" in done
    same_report(local, done["out"])


def test_lost_client_resumes(path, tmp_path, cluster, monkeypatch):
    local = kvsim.run(path, tmp_path / "local", workers=2)
    variants = kvsim.load_sweep(path)
    store = UnitStore(tmp_path / ".remote.units", resume=False)

    class LostClient:  # the client goes away when the first task is back
        def update(self, n):
            raise KeyboardInterrupt

    with distributed_dask.Client(cluster.scheduler_address) as client:
        with pytest.raises(KeyboardInterrupt):
            distributed.simulate_variants(client, variants, store=store, bar=LostClient())
    saved = len(list(store.folder.glob("*.npz")))
    assert saved == 6 * 2  # one head: the 6 policies of its 2 experiments

    computed = []  # the client saves each unit the cluster computed
    monkeypatch.setattr(UnitStore, "save", lambda self, key, traces: computed.append(key))
    out = kvsim.run(path, tmp_path / "remote", dask=cluster.scheduler_address, resume=True)
    total = 2 * 2 * 2 * 6 * 2  # variants x seeds x KV heads x policies x experiments
    assert len(computed) == total - saved
    same_report(local, out)


def test_unreachable_scheduler_is_one_line_and_exit_2(path, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(distributed, "CONNECT_TIMEOUT", 1.0)
    out = tmp_path / "r"
    assert main([str(path), "--out", str(out), "--quiet", "--dask", "tcp://127.0.0.1:9"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("kvsim: --dask tcp://127.0.0.1:9: expected a reachable Dask scheduler")
    assert list(tmp_path.iterdir()) == [path]  # nothing written


@pytest.mark.parametrize("address", ["local:0", "local:x"])
def test_bad_local_cluster_size(path, tmp_path, capsys, address):
    assert main([str(path), "--out", str(tmp_path / "r"), "--quiet", "--dask", address]) == 2
    assert "expected local:N with N >= 1" in capsys.readouterr().err


def _trace(path, seed):
    rng = np.random.default_rng(seed)
    np.savez(path, queries=rng.normal(size=(1, 2, 64, 8)).astype(np.float16),
             keys=rng.normal(size=(1, 1, 64, 8)).astype(np.float16),
             values=rng.normal(size=(1, 1, 64, 8)).astype(np.float16))


TRACES = """\
name = "traces"
[attention]
source = "trace"
path = "traces/*.npz"
[policies.h2o]
[policies.window]
[[experiment]]
prompt_len = 32
budgets = [8]
"""


def test_trace_glob_gives_one_variant_per_file(tmp_path):
    (tmp_path / "traces").mkdir()
    for i, name in enumerate(("b.npz", "a.npz")):
        _trace(tmp_path / "traces" / name, i)
    path = tmp_path / "traces.toml"
    path.write_text(TRACES)
    variants = kvsim.load_sweep(path)
    assert [v.attention["path"] for v in variants] == ["traces/a.npz", "traces/b.npz"]
    assert [v.variant_label for v in variants] == ["attention.path=traces/a.npz",
                                                   "attention.path=traces/b.npz"]
    path.write_text(TRACES.replace("*.npz", "*.none"))
    with pytest.raises(kvsim.ScenarioError, match=r"attention.path: expected at least one "
                                                  r"trace file matching 'traces/\*.none'"):
        kvsim.load_sweep(path)
