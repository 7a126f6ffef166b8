"""Forked worker processes for the studies: they inherit the parent's model and settings
(:data:`FORKED`) instead of receiving them, and an interrupt stops them at once
(:func:`kvsim.forked.forked_pool`). The numbers never depend on the number of workers:
each job decodes alone, torch on one thread."""

from __future__ import annotations

from concurrent.futures import as_completed
from typing import Callable, Iterable

from kvsim.forked import forked_pool as _forked_pool

FORKED: dict = {}
"""What forked workers inherit: ``FORKED["job"]``, the model, its runs and settings, set by
the parent before the pool forks; ``FORKED["queue"]``, in a worker, the pool's queue."""


def _worker_init(queue=None) -> None:
    FORKED["queue"] = queue


def forked_pool(workers: int, queue=None):
    """A pool of ``workers`` forked processes that an interrupt stops at once
    (:func:`kvsim.forked.forked_pool`), each given ``queue`` (``FORKED["queue"]``)."""
    return _forked_pool(workers, _worker_init, (queue,))


def forked_map(fn: Callable, items: Iterable, workers: int, job, bar=None) -> list:
    """``[fn(item) for item in items]``, in order, on up to ``workers`` forked processes
    (here when ``workers`` <= 1), each of which inherits ``job`` as ``FORKED["job"]``;
    ``bar.update()`` as each item is done."""
    items = list(items)
    FORKED["job"] = job
    try:
        if workers <= 1:
            out = []
            for item in items:  # (tqdm's update may return True: not an `or` chain)
                out.append(fn(item))
                if bar is not None:
                    bar.update()
            return out
        with forked_pool(min(workers, len(items))) as pool:
            futures = [pool.submit(fn, item) for item in items]
            for _ in as_completed(futures):
                if bar is not None:
                    bar.update()
            return [fut.result() for fut in futures]
    finally:
        FORKED.clear()
