"""What a study's job holds where it runs (a forked worker process, a Dask worker or this
process): :data:`FORKED`, and :func:`tick`, its progress."""

from __future__ import annotations

FORKED: dict = {}
"""What a job's worker holds: ``FORKED["job"]``, the model, its runs and settings (set by
the parent before the pool forks; on a cluster, sent to each worker);
``FORKED["tick"]``, where :func:`tick` counts."""


def tick(n: int) -> None:
    """From a job of a map with a ``weight``: advance the map's progress bar by ``n`` now
    (from a forked worker through a queue, from a cluster's worker as a Dask event)."""
    FORKED.get("tick", nothing)(n)


def nothing(n: int) -> None:
    """Count nowhere: where no progress bar follows a job."""
