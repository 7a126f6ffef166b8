"""Where a study's maps run (:func:`study_map`): forked worker processes that inherit the
parent's model and settings (:data:`FORKED`) instead of receiving them, and that an
interrupt stops at once (:func:`kvsim.forked.forked_pool`); or, with ``--dask``, a Dask
cluster (:mod:`.cluster`). The numbers never depend on where: each job decodes alone, torch
on one thread."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import FIRST_COMPLETED, wait
from queue import Empty
from typing import Callable, Iterable

from kvsim.forked import forked_pool as _forked_pool

FORKED: dict = {}
"""What a job's worker holds: ``FORKED["job"]``, the model, its runs and settings (set by
the parent before the pool forks; on a cluster, sent to each worker);
``FORKED["tick"]``, where :func:`tick` counts."""


def _worker_init(queue=None) -> None:
    if queue is not None:
        FORKED["tick"] = queue.put


def forked_pool(workers: int, queue=None):
    """A pool of ``workers`` forked processes that an interrupt stops at once
    (:func:`kvsim.forked.forked_pool`), whose :func:`tick` puts on ``queue``."""
    return _forked_pool(workers, _worker_init, (queue,))


def tick(n: int) -> None:
    """From a job of a map with a ``weight``: advance the map's progress bar by ``n`` now
    (on a cluster the bar advances when the job is done instead)."""
    FORKED.get("tick", _nothing)(n)


def _nothing(n: int) -> None:
    pass


def study_map(fn: Callable, items: Iterable, workers: int, job, bar=None,
              weight: Callable | None = None) -> list:
    """``[fn(item) for item in items]``, in order: on the open Dask cluster
    (:func:`~kvsim.tools.study.cluster.on_cluster`), else on up to ``workers`` forked
    processes (:func:`forked_map`). ``fn`` reads ``job`` as ``FORKED["job"]``. ``bar``
    advances by one as each item is done; with ``weight``, by what ``fn`` counts with
    :func:`tick` as it runs (on a cluster: by ``weight(item)`` when the item is done)."""
    from kvsim.tools.study import cluster

    if cluster.active() is not None:
        return cluster.cluster_map(fn, list(items), job, bar, weight)
    return forked_map(fn, items, workers, job, bar, ticks=weight is not None)


def forked_map(fn: Callable, items: Iterable, workers: int, job, bar=None,
               ticks: bool = False) -> list:
    """``[fn(item) for item in items]``, in order, on up to ``workers`` forked processes
    (here when one would do), each of which inherits ``job`` as ``FORKED["job"]``;
    ``bar.update()`` as each item is done, or, with ``ticks``, ``bar.update(n)`` as ``fn``
    calls :func:`tick`."""
    items = list(items)
    update = bar.update if bar is not None else _nothing
    FORKED["job"] = job
    try:
        if min(workers, len(items)) <= 1:
            if ticks:
                FORKED["tick"] = update
            out = []
            for item in items:  # (tqdm's update may return True: not an `or` chain)
                out.append(fn(item))
                if not ticks:
                    update(1)
            return out
        queue = mp.get_context("fork").Queue() if ticks else None
        with forked_pool(min(workers, len(items)), queue) as pool:
            futures = [pool.submit(fn, item) for item in items]
            pending = set(futures)
            while pending:
                if queue is None:
                    done, pending = wait(pending, return_when=FIRST_COMPLETED)
                    for future in done:
                        future.result()  # a job's error, raised at once
                        update(1)
                    continue
                try:
                    update(queue.get(timeout=0.2))
                except Empty:
                    pass
                for future in [f for f in pending if f.done()]:
                    pending.discard(future)
                    future.result()
            return [future.result() for future in futures]
    finally:
        FORKED.clear()
