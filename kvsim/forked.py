"""Forked worker processes that leave interrupts to their parent.

Ctrl-C reaches every process of the terminal's process group: workers that kept Python's
SIGINT handler would each print a traceback. Here the workers ignore SIGINT and take
SIGTERM's default action, and the parent, on any exception in the ``with`` block (Ctrl-C,
or SIGTERM that the command line turns into one), terminates them instead of awaiting
their jobs.
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager

_STOP = {signal.SIGINT, signal.SIGTERM}


class WorkerLost(OSError):
    """A worker process ended abruptly: the machine's doing (most often the system's
    out-of-memory killer), so the command line gives it as one line, exit status 1."""


def _worker_init(initializer, initargs) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP)
    if initializer is not None:
        initializer(*initargs)


@contextmanager
def forked_pool(workers: int, initializer=None, initargs: tuple = ()):
    """A ``ProcessPoolExecutor`` of ``workers`` forked processes, all started at once
    with SIGINT and SIGTERM blocked (so none can receive them before it ignores them)."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP)
    pool = None
    try:
        pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"),
                                   initializer=_worker_init, initargs=(initializer, initargs))
        pool.submit(int)  # forks every worker now (fork starts them all on the first job)
        # A signal that came while blocked arrives here: inside the try, which stops the
        # workers (raised before it, it left them waiting for jobs, orphaned, for ever).
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        yield pool
    except BaseException as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        if pool is not None:
            _stop(pool)
        if isinstance(exc, BrokenProcessPool):
            raise WorkerLost(f"a worker process of {workers} ended abruptly (killed, most often "
                             f"by the system for want of memory); no report written: run with "
                             f"fewer --workers") from None
        raise
    pool.shutdown()


def _stop(pool: ProcessPoolExecutor) -> None:
    """Terminate the pool's workers without awaiting their jobs; return once they are gone
    (before the caller removes what they were writing)."""
    processes = list(pool._processes.values())  # the executor's own workers
    # Shut down first: the executor then drops its cancelled jobs before it sees the
    # workers die (Python 3.11 fails on them otherwise, with a thread's traceback).
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    for process in processes:
        process.join(5)
