"""Where a study's maps run (:func:`study_map`): forked worker processes that inherit the
parent's model and settings (:data:`~kvsim.tools.study.job.FORKED`) instead of receiving them, and that an
interrupt stops at once (:func:`kvsim.forked.forked_pool`); or, with ``--dask``, a Dask
cluster (:mod:`.cluster`). The numbers never depend on where: each job decodes alone, torch
on one thread."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import as_completed
from queue import Empty
from typing import Callable, Iterable

from kvsim.forked import forked_pool as _forked_pool
from kvsim.tools.study import cluster
from kvsim.tools.study.job import FORKED, nothing


def _worker_init(queue=None) -> None:
    if queue is not None:
        FORKED["tick"] = queue.put


def forked_pool(workers: int, queue=None):
    """A pool of ``workers`` forked processes that an interrupt stops at once
    (:func:`kvsim.forked.forked_pool`), whose :func:`~kvsim.tools.study.job.tick` puts on ``queue``."""
    return _forked_pool(workers, _worker_init, (queue,))


def _take(queue, update, timeout: float) -> int:
    """The next tick on ``queue`` (0 if none comes within ``timeout`` seconds), counted."""
    try:
        n = queue.get(timeout=timeout)
    except Empty:
        return 0
    update(n)
    return n


def _follow(futures: list, queue, update, expected: int) -> None:
    """Count the ticks on ``queue`` until every future is done (a job's error raised at
    once) and the ``expected`` ticks are in (the last ones of a finished job may still be
    on their way)."""
    ticked, pending = 0, set(futures)
    while pending:
        ticked += _take(queue, update, 0.2)
        for future in [f for f in pending if f.done()]:
            pending.discard(future)
            future.result()
    while ticked < expected and (n := _take(queue, update, 5.0)):
        ticked += n


def study_map(fn: Callable, items: Iterable, workers: int, job, bar=None,
              weight: Callable | None = None) -> list:
    """``[fn(item) for item in items]``, in order: on the open Dask cluster
    (:func:`~kvsim.tools.study.cluster.on_cluster`), else on up to ``workers`` forked
    processes (:func:`forked_map`). ``fn`` reads ``job`` as ``FORKED["job"]``. ``bar``
    advances by one as each item is done; with ``weight``, by what ``fn`` counts with
    :func:`~kvsim.tools.study.job.tick` as it runs (``weight(item)`` in all for an item)."""
    if cluster.active() is not None:
        return cluster.cluster_map(fn, list(items), job, bar, weight)
    return forked_map(fn, items, workers, job, bar, weight)


def forked_map(fn: Callable, items: Iterable, workers: int, job, bar=None,
               weight: Callable | None = None) -> list:
    """``[fn(item) for item in items]``, in order, on up to ``workers`` forked processes
    (here when one would do), each of which inherits ``job`` as ``FORKED["job"]``;
    ``bar.update()`` as each item is done, or, with ``weight``, ``bar.update(n)`` as ``fn``
    calls :func:`~kvsim.tools.study.job.tick` (``weight(item)`` in all for an item)."""
    items = list(items)
    update = bar.update if bar is not None else nothing
    FORKED["job"] = job
    try:
        if min(workers, len(items)) <= 1:
            if weight is not None:
                FORKED["tick"] = update
            out = []
            for item in items:  # (tqdm's update may return True: not an `or` chain)
                out.append(fn(item))
                if weight is None:
                    update(1)
            return out
        queue = mp.get_context("fork").Queue() if weight is not None else None
        with forked_pool(min(workers, len(items)), queue) as pool:
            futures = [pool.submit(fn, item) for item in items]
            if queue is None:
                for future in as_completed(futures):
                    future.result()  # a job's error, raised at once
                    update(1)
            else:
                _follow(futures, queue, update, sum(map(weight, items)))
            return [future.result() for future in futures]
    finally:
        FORKED.clear()
