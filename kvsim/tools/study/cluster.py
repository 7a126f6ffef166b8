"""A study's maps on a Dask cluster (``kvsim task|closed-loop FILE --dask ADDRESS``).

While :func:`on_cluster` is open, :func:`~kvsim.tools.study.workers.study_map` sends each
item of a map (a trial, a batch of runs, a policy's open loop) to the cluster as one Dask
task, in place of forked processes. A job's parts are scattered to every worker once per
run; its model is not: the model the study loaded through :func:`load_shared` travels as
how to load it, and each worker process loads it once, on its first task, and keeps it
for every later task (and run). Each task runs alone in its process, torch on one thread,
as a forked worker runs it: the results are the bytes of a local run.
"""

from __future__ import annotations

import threading
import uuid
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from kvsim.errors import KvsimError
from kvsim.tools.study.job import FORKED

_ACTIVE: list = []  # (client, {id: (part, future)}) of the open cluster: its scattered parts
_SOURCES: dict = {}  # id(net) -> (how it was loaded, tokenizer), while the net lives
_LOADED: dict = {}  # on a worker: (net, tokenizer) by source key, loaded once per process
_LOCK = threading.Lock()  # on a worker: one task at a time, as in a forked process


@dataclass(frozen=True)
class _Source:
    """How a worker gets the study's model: ``load(name, gguf_file)``; ``part`` 0 is the
    net, 1 its tokenizer."""

    load: Callable
    name: str
    gguf_file: str | None
    part: int

    def here(self):
        """The net or tokenizer in this process, loaded (and attached) on first use."""
        key = (getattr(self.load, "__module__", None), getattr(self.load, "__qualname__", None),
               self.name, self.gguf_file)
        if key not in _LOADED:
            from kvsim.models.adapter import attach

            net, tokenizer = self.load(self.name, self.gguf_file)
            attach(net)
            _LOADED[key] = (net, tokenizer)
        return _LOADED[key][self.part]


def load_shared(load: Callable, name: str, gguf_file: str | None = None):
    """``load(name, gguf_file)``, the study's ``(net, tokenizer)``, remembering how it was
    loaded: in a job sent to a cluster, they travel as that, and each worker loads its own
    copy once (:class:`_Source`)."""
    net, tokenizer = load(name, gguf_file)
    _SOURCES[id(net)] = ((load, name, gguf_file), tokenizer)
    weakref.finalize(net, _SOURCES.pop, id(net), None)
    return net, tokenizer


def _shipped(job: tuple) -> list:
    """``job`` with the model loaded by :func:`load_shared` as its sources."""
    sources = {}
    for part in job:
        found = _SOURCES.get(id(part))
        if found is not None:
            (load, name, gguf), tokenizer = found
            sources[id(part)] = _Source(load, name, gguf, 0)
            sources[id(tokenizer)] = _Source(load, name, gguf, 1)
    return [sources.get(id(part), part) for part in job]


def active():
    """The client of the open cluster, or None (maps run locally)."""
    return _ACTIVE[-1][0] if _ACTIVE else None


@contextmanager
def on_cluster(address: str | None) -> Iterator:
    """While inside, the study's maps run on the Dask cluster at ``address``
    (``tcp://HOST:PORT`` or ``local:N``; None: locally, and this yields None). Yields the
    client; a malformed or unreachable address, a cluster without a worker or with other
    kvsim sources, or a missing ``distributed`` is a one-line :class:`KvsimError`, raised
    before the block runs."""
    if address is None:
        yield None
        return
    from kvsim.engine.distributed import check_address, connect

    if not isinstance(address, str):
        raise KvsimError(f"dask: expected a scheduler address 'tcp://HOST:PORT' or "
                         f"'local:N', got {address!r}")
    check_address(address)
    with connect(address) as client:
        _ACTIVE.append((client, {}))
        try:
            yield client
        finally:
            _ACTIVE.pop()


def worker_count(client) -> int:
    """The cluster's worker processes now."""
    return len(client.scheduler_info()["workers"])


def _share(part):
    """A future of ``part`` on every worker (scattered once per run), or ``part`` itself
    when it is small enough to travel with each task."""
    if part is None or callable(part) or isinstance(part, (bool, int, float, str, _Source)):
        return part
    client, shared = _ACTIVE[-1]
    if id(part) not in shared:  # the part is kept alive with its future: ids stay unique
        shared[id(part)] = (part, client.scatter([part], broadcast=True, hash=False)[0])
    return shared[id(part)][1]


def _run_task(fn: Callable, job: list, item, ticks: tuple | None):
    """On a worker: ``fn(item)`` with the job (its model loaded here, once per process) as
    ``FORKED["job"]``, alone in the process, torch on one thread; with ``ticks`` (topic,
    index), its :func:`~kvsim.tools.study.job.tick` calls go to the client as events."""
    from kvsim.models.threads import one_thread

    with _LOCK, one_thread():
        FORKED["job"] = tuple(p.here() if isinstance(p, _Source) else p for p in job)
        if ticks is not None:
            from distributed import get_worker

            worker, (topic, index) = get_worker(), ticks
            FORKED["tick"] = lambda n: worker.log_event(topic, (index, n))
        try:
            return fn(item)
        finally:
            FORKED.clear()


class _Progress:
    """A map's bar on the client: each item's ticks as its events arrive, then the rest of
    its weight (1 without ``weight``) when it is done; late events are dropped."""

    def __init__(self, bar, weight: Callable | None, items: list):
        self.bar, self.weight, self.items = bar, weight, items
        self.ticked = [0] * len(items)
        self.done_ = [False] * len(items)
        self.lock = threading.Lock()  # events come on the client's event-loop thread

    def event(self, event) -> None:
        index, n = event[1]
        with self.lock:
            if not self.done_[index]:
                self.ticked[index] += n
                self.bar.update(n)

    def done(self, index: int) -> None:
        with self.lock:
            self.done_[index] = True
            whole = self.weight(self.items[index]) if self.weight else 1
            self.bar.update(whole - self.ticked[index])


def cluster_map(fn: Callable, items: list, job: tuple, bar=None,
                weight: Callable | None = None) -> list:
    """``[fn(item) for item in items]``, in order, each item one task on the open cluster
    (:func:`on_cluster`); ``bar`` advances by one as each item is done, or, with
    ``weight``, by what ``fn`` counts with :func:`~kvsim.tools.study.job.tick` as it
    runs (``weight(item)`` in all for an item)."""
    from dask.distributed import as_completed
    from distributed.scheduler import KilledWorker

    client = active()
    job = [_share(part) for part in _shipped(job)]
    run = f"kvsim-{fn.__name__}-{uuid.uuid4().hex[:8]}"
    progress = _Progress(bar, weight, items) if bar is not None else None
    ticks = progress is not None and weight is not None
    if ticks:
        client.subscribe_topic(run, progress.event)
    futures = [client.submit(_run_task, fn, job, item, (run, i) if ticks else None,
                             key=f"{run}-{i}", pure=False) for i, item in enumerate(items)]
    index = {future.key: i for i, future in enumerate(futures)}
    try:
        for future in as_completed(futures):
            try:
                future.result()  # a task's error, raised here as it was there
            except KilledWorker as exc:  # the scheduler gave up after repeated worker deaths
                raise KvsimError(f"--dask: task {future.key} lost its worker too often "
                                 f"({exc})") from None
            if progress is not None:
                progress.done(index[future.key])
        return [future.result() for future in futures]
    finally:
        client.cancel(futures)
        if ticks:
            client.unsubscribe_topic(run)
