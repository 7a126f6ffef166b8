"""Run a scenario's units on a Dask cluster (``--dask ADDRESS`` or ``--dask local:N``).

One task per (variant, seed, KV head) runs every unit of that head (each experiment's
policies at all their budgets) on one worker, so the head's full pass is computed once,
where its units run. A task carries the scenario spec (a few kB) and returns the units'
traces (per-step series, O(steps) per run): workers rebuild component fields from the
spec and read traces and matrices from their paths, so no T x T array crosses the
network. The client saves each unit to the resume store as its task completes, then
assembles the report through the local engine's own code from those stored traces, so
the results are the same bytes as a local run's.
"""

from __future__ import annotations

import os
import re
import uuid
from contextlib import contextmanager
from typing import Iterator

from tqdm import tqdm

from kvsim.engine.allocation import layer_caps
from kvsim.engine.experiments import (ScenarioResults, head_group, simulate_scenario, snap_steps,
                                      unit_keys)
from kvsim.engine.resume import UnitStore
from kvsim.errors import KvsimError
from kvsim.protocols.run import get_policy, make_group, run_budgets
from kvsim.scenario.load import Scenario

CONNECT_TIMEOUT = 10.0  # seconds to reach a scheduler and see its first worker

_LOCAL = re.compile(r"local:(\d+)")
_REMOTE = re.compile(r"(?:(tcp|tls|ws|wss)://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d+)")


def max_local_workers() -> int:
    """The most worker processes ``local:N`` may start: 4 per core, at least 8."""
    return max(8, 4 * (os.cpu_count() or 1))


def check_address(address: str) -> str:
    """``address`` if it is ``local:N`` (1 <= N <= :func:`max_local_workers`) or
    ``[tcp|tls|ws|wss://]HOST:PORT`` (port 1 to 65535); else :class:`KvsimError`, before
    anything starts."""
    limit = max_local_workers()
    if address.startswith("local:"):
        local = _LOCAL.fullmatch(address)
        if not (local and 1 <= int(local[1]) <= limit):
            raise KvsimError(f"--dask: expected local:N with N >= 1 worker processes "
                             f"(at most {limit} on this machine), got {address!r}")
        return address
    remote = _REMOTE.fullmatch(address)
    if not (remote and 1 <= int(remote[3]) <= 65535):
        raise KvsimError(f"--dask: expected a scheduler address tcp://HOST:PORT (port 1 to "
                         f"65535) or local:N, got {address!r}")
    return address


def _source_digest() -> str:
    from kvsim.numerics.jit import _source_digest as digest

    return digest()


def _probe(address: str) -> None:
    """Ask ``address`` what it is, within ``CONNECT_TIMEOUT``: a port that accepts and
    never answers, or answers something other than Dask, fails here in one line
    (``Client`` itself can wait for ever on such a port)."""
    import asyncio

    from distributed.comm import connect as open_comm

    async def identity():
        comm = await open_comm(address, timeout=CONNECT_TIMEOUT)
        try:
            await comm.write({"op": "identity"})
            return await comm.read()
        finally:
            comm.abort()

    try:
        reply = asyncio.run(asyncio.wait_for(identity(), CONNECT_TIMEOUT))
    except (TimeoutError, asyncio.TimeoutError):
        raise KvsimError(f"--dask {address}: expected a reachable Dask scheduler, got no "
                         f"answer within {CONNECT_TIMEOUT:g} s") from None
    except OSError as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvsimError(f"--dask {address}: expected a reachable Dask scheduler "
                         f"({reason})") from None
    except Exception:  # what a reply that is not Dask's makes of the protocol
        reply = None
    if not (isinstance(reply, dict) and reply.get("type") == "Scheduler"):
        raise KvsimError(f"--dask {address}: expected a Dask scheduler, got a server that "
                         f"is not one")


@contextmanager
def connect(address: str) -> Iterator:
    """A ``dask.distributed.Client`` for ``address`` (``tcp://HOST:PORT`` or ``local:N``).

    ``local:N`` starts a ``LocalCluster`` of N single-threaded worker processes for the
    duration. Raises :class:`KvsimError` (one line) when the scheduler cannot be reached,
    has no worker, or a worker runs different kvsim sources.
    """
    check_address(address)
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError:
        raise KvsimError("--dask: expected dask.distributed to be installed: the "
                         "distributed extra (pip install -e \".[distributed]\")") from None
    local = _LOCAL.fullmatch(address)
    if not local:
        _probe(address)
    cluster = None
    try:
        if local:
            cluster = LocalCluster(n_workers=int(local[1]), threads_per_worker=1,
                                   processes=True, dashboard_address=":0")
            client = Client(cluster)
        else:
            client = Client(address, timeout=CONNECT_TIMEOUT)
    except Exception as exc:  # anything the handshake raises: not a Dask scheduler we can use
        if cluster is not None:
            cluster.close()
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise KvsimError(f"--dask {address}: expected a reachable Dask scheduler answering "
                         f"within {CONNECT_TIMEOUT:g} s ({reason})") from None
    try:
        try:
            client.wait_for_workers(1, timeout=CONNECT_TIMEOUT)
        except TimeoutError:
            raise KvsimError(f"--dask {address}: expected at least one worker, got none "
                             f"within {CONNECT_TIMEOUT:g} s (start one: dask worker "
                             f"{address})") from None
        digests = client.run(_source_digest)
        own = _source_digest()
        for worker, digest in digests.items():
            if digest != own:
                raise KvsimError(f"--dask {address}: expected workers running these kvsim "
                                 f"sources (digest {own}), worker {worker} has {digest}")
        yield client
    finally:
        client.close()
        if cluster is not None:
            cluster.close()


def _head_units(scenario: Scenario, seed: int, kv: int, done: frozenset[str],
                field_passes: bool) -> tuple[dict, dict]:
    """On a worker: the traces of every unit of one KV head not in ``done``, by unit key,
    and (if ``field_passes``) the head's full passes the field figures read."""
    sequence = scenario.field(seed)
    passes: dict = {}
    traces = {}
    for exp in scenario.experiments:
        snaps = snap_steps(exp, scenario.T)
        keys = unit_keys(scenario, exp, seed, kv, snaps, scenario.layers[0],
                         layer_caps(scenario, exp, None, 0))
        todo = [i for i, key in enumerate(keys) if key not in done]
        if todo:
            group = head_group(scenario, sequence, passes, seed, kv, exp, snaps)
            for i in todo:
                config = exp.policies[i]
                traces[keys[i]] = run_budgets(get_policy(config.kind), group,
                                              list(exp.budgets), config.params)
    shipped = {}
    if field_passes:  # the first experiment's passes, as the local engine's figures use them
        P = scenario.experiments[0].prompt_len
        group = make_group(sequence.data, kv, P, sequence.mask, passes, scenario.gqa_mode)
        group.passes()
        shipped = {key: p for key, p in passes.items()
                   if key[1] == P and key[2] == scenario.T and int(key[0]) in group.heads}
    return traces, shipped


def _check_supported(scenario: Scenario) -> None:
    """Tasks run one KV head of one layer with budget B: several layers run jointly,
    budget allocation (caps shared across heads and layers) and KIVI storage are local-only."""
    if len(scenario.layers) > 1:
        raise KvsimError(f"--dask: expected one layer per run on a cluster, got "
                         f"{len(scenario.layers)} layers run jointly (run without --dask)")
    for exp in scenario.experiments:
        if exp.allocation != "uniform":
            raise KvsimError(f"--dask: expected allocation = 'uniform' on a cluster, got "
                             f"{exp.allocation!r} in experiment {exp.name!r} (run without --dask)")
        if exp.quantize is not None:
            raise KvsimError(f"--dask: expected no [experiment.quantize] on a cluster, got one "
                             f"in experiment {exp.name!r} (run without --dask)")


class _Collected:
    """The units a cluster returned, read like a resume store by the local engine."""

    def __init__(self, traces: dict, store: UnitStore | None):
        self.traces = traces
        self.store = store

    def load(self, key: str):
        return self.traces.get(key)

    def save(self, key: str, traces) -> None:  # a unit the cluster did not run (none expected)
        if self.store is not None:
            self.store.save(key, traces)


def simulate_variants(client, variants: list[Scenario], *, store: UnitStore | None = None,
                      bar: tqdm | None = None) -> list[ScenarioResults]:
    """Run the units of every variant on ``client``'s cluster; results as a local run's.

    Every (variant, seed, KV head) with units left (or whose full passes the field figures
    need) becomes one task; ``bar`` advances as tasks finish, and each finished unit is
    saved to ``store`` at once, so ``--resume`` works after a lost client.
    """
    from dask.distributed import as_completed
    from distributed.scheduler import KilledWorker

    for scenario in variants:
        _check_supported(scenario)
    run_id = uuid.uuid4().hex[:8]
    collected: list[dict] = [{} for _ in variants]
    passes: list[dict] = [{} for _ in variants]
    futures = {}
    for v, scenario in enumerate(variants):
        heads_per_kv = scenario.heads // scenario.kv_heads
        for seed in scenario.seeds:
            for kv in range(scenario.kv_heads):
                runs, done = 0, set()
                for exp in scenario.experiments:
                    for key in unit_keys(scenario, exp, seed, kv, snap_steps(exp, scenario.T),
                                         scenario.layers[0], layer_caps(scenario, exp, None, 0)):
                        stored = store.load(key) if store else None
                        if stored is not None:
                            collected[v][key] = stored
                            done.add(key)
                            if bar is not None:
                                bar.update(heads_per_kv * len(exp.budgets))
                        else:
                            runs += heads_per_kv * len(exp.budgets)
                first = seed == scenario.seeds[0]
                if runs or first:
                    future = client.submit(_head_units, scenario, seed, kv, frozenset(done), first,
                                           key=f"kvsim-{run_id}-v{v}-seed{seed}-kv{kv}",
                                           pure=False)
                    futures[future] = (v, seed, runs)
    for future in as_completed(futures):
        v, seed, runs = futures.pop(future)
        try:
            traces, shipped = future.result()
        except KilledWorker as exc:  # the scheduler gave up after repeated worker deaths
            raise KvsimError(f"--dask: task {future.key} lost its worker too often ({exc})") \
                from None
        for key, unit in traces.items():
            if store is not None:
                store.save(key, unit)
            collected[v][key] = unit
        passes[v].setdefault(seed, {}).update(shipped)
        if bar is not None:
            bar.update(runs)
    return [simulate_scenario(scenario, progress=False, workers=1,
                              store=_Collected(collected[v], store), known_passes=passes[v])
            for v, scenario in enumerate(variants)]
