"""``kvsim.run``: run a scenario (every variant of its sweep) and write its report folder."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from tqdm import tqdm

from kvsim.api import arguments
from kvsim.engine.cost import check as check_cost
from kvsim.engine.distributed import check_address, connect, simulate_variants
from kvsim.engine.experiments import simulate_scenario
from kvsim.engine.resume import UnitStore
from kvsim.errors import KvsimError
from kvsim.report import figures, markdown
from kvsim.report.lock import ReportLock, clean_leftovers, sibling
from kvsim.report.writer import check_out, default_out, git_commit, write_report
from kvsim.scenario.load import Scenario, load_sweep
from kvsim.scenario.overrides import Overrides


def run(scenario: Scenario | list[Scenario] | str | Path, out: str | Path | None = None, *,
        force: bool = False, progress: bool = False, workers: int | None = None,
        resume: bool = False, overrides: Overrides | None = None, dask: str | None = None,
        command: str | None = None) -> Path:
    """Run every experiment of a scenario (every variant of its sweep) and write the report.

    Parameters
    ----------
    scenario : a :class:`Scenario`, a list of sweep variants, or a scenario file's path.
    out : report folder (default ``reports/<scenario name>``).
    force : replace a report kvsim wrote for another scenario file (a report of the same
        file is replaced anyway, a folder kvsim did not write never is).
    progress : show a progress bar on stderr.
    workers : threads running policies, in parallel (default: every core); figures are
        drawn in this process.
    resume : reuse the units an interrupted run of the same report already finished.
    overrides : command-line changes applied to a scenario file before validation.
    dask : run the units on a Dask cluster: a scheduler address (``tcp://HOST:PORT``) or
        ``local:N`` (a local cluster of N worker processes); same results as a local run.
    command : the command line to record in the report (default: the Python call).

    Returns
    -------
    Path
        The report folder.

    Notes
    -----
    The run owns ``out`` while it works (:mod:`kvsim.report.lock`): a second run on the
    same folder is refused, and leftovers of killed runs are cleaned (or, with
    ``resume``, their finished units reused). A run that is interrupted or fails removes
    its finished units, unless started with ``resume``: then they stay, and the
    exception's ``kept_units`` names their folder. A run whose estimated peak memory exceeds
    the limit is refused before any work (:mod:`kvsim.engine.cost`).
    """
    if isinstance(scenario, Scenario):
        variants = [scenario]
    elif isinstance(scenario, list):
        variants = scenario
    else:
        variants = load_sweep(scenario, overrides)
    figures.check(variants)
    workers = arguments.workers(workers)
    if dask is not None:
        if not isinstance(dask, str):
            raise KvsimError(f"dask: expected a scheduler address 'tcp://HOST:PORT' or "
                             f"'local:N', got {dask!r}")
        check_address(dask)
    out = Path(out) if out is not None else default_out(variants[0])
    check_out(out, force, variants[0])
    cost = check_cost(variants, workers)
    provenance = markdown.Provenance.start(command, workers)
    provenance.commit = git_commit()
    with connect(dask) if dask else nullcontext() as client, ReportLock(out):
        clean_leftovers(out, keep_units=resume)
        check_out(out, force, variants[0])
        store = UnitStore(sibling(out, ".units"), resume)
        try:
            with tqdm(total=cost.runs, unit="run", disable=not progress, dynamic_ncols=True,
                      desc=variants[0].name) as bar:
                if client:
                    results = simulate_variants(client, variants, store=store, bar=bar)
                else:
                    results = [simulate_scenario(v, workers=workers, store=store, bar=bar,
                                                 progress=progress) for v in variants]
            write_report(out, variants, results, force, workers, provenance, progress)
        except BaseException as exc:  # interrupted or failed: the units only serve --resume
            store.close(keep=resume)  # policy threads still running save nothing more
            if resume and store.folder.exists():
                exc.kept_units = store.folder  # the command line says where they are
            raise
        store.close(keep=False)  # finished: nothing left to resume
    return out
