"""Write a run's report folder atomically: results.csv, steps.npz, scenario.json, figures."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvsim._version import __version__
from kvsim.report import bytes_figure, figures, markdown, protocol_summary, selection
from kvsim.report.studies import STUDIES
from kvsim.engine.experiments import ScenarioResults
from kvsim.engine.records import steps_arrays, write_rows
from kvsim.errors import KvsimError
from kvsim.npz import write_npz
from kvsim.scenario.load import Scenario
from kvsim.report.lock import replace_folder
from kvsim.report.plotting import Ledger


def default_out(scenario: Scenario) -> Path:
    """``reports/<scenario name>`` under the working directory."""
    return Path("reports") / scenario.name


def _written_for(out: Path) -> Path | None:
    """The scenario file of the kvsim report in ``out``, or None if kvsim did not write it
    (kvsim's ``scenario.json`` names the kvsim version and the scenario file)."""
    try:
        meta = json.loads((out / "scenario.json").read_text())
        if "kvsim" not in meta["versions"]:
            return None
        return (Path.cwd() / meta["variants"][0]["path"]).resolve()
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def check_out(out: Path, force: bool, scenario: Scenario | None = None) -> str | None:
    """Whether ``out`` may receive the report; returns a note for stderr when it replaces one.

    A folder kvsim did not write is never replaced (an empty one is filled); a report kvsim
    wrote for the same scenario file is replaced; a report of another scenario needs ``force``.
    """
    _check_place(out)
    if not out.exists():
        return None
    if not out.is_dir():
        raise KvsimError(f"{out}: expected a folder, got a file")
    if not any(out.iterdir()):
        return None
    source = _written_for(out)
    if source is None:
        raise KvsimError(f"{out}: expected a new folder or a report kvsim wrote, got a folder "
                         f"without kvsim's scenario.json (kvsim never replaces it; choose "
                         f"another --out)")
    if scenario is not None and source == scenario.path.resolve():
        return _replacing(out, f"an earlier report of {scenario.path}")
    if not force:
        raise KvsimError(f"{out}: expected a new output folder, got a report of {source} "
                         f"(use --force to replace it)")
    return _replacing(out, f"a report of {source} (--force)")


def check_study_out(out: Path, force: bool, marker: str, name: str, what: str) -> str | None:
    """:func:`check_out` for a closed-loop or task report, which kvsim marks by its
    ``marker`` file (``settings.name`` inside): a report of the same study ``name`` is
    replaced, another needs ``force``. Returns the note for stderr when it replaces one."""
    try:
        written = json.loads((out / marker).read_text())["settings"]["name"]
    except (OSError, ValueError, KeyError, TypeError):
        return check_out(out, force)  # new, empty, a scenario report, or not kvsim's
    _check_place(out)
    if written == name:
        return _replacing(out, f"an earlier {what} report of {name}")
    if not force:
        raise KvsimError(f"{out}: expected a new output folder, got the {what} report of "
                         f"{written!r} (use --force to replace it)")
    return _replacing(out, f"the {what} report of {written!r} (--force)")


def _replacing(out: Path, what: str) -> str:
    """The note on replacing the report ``what`` in ``out``, once sure that the report can
    be removed after its replacement (every folder in it writable): refused before any
    work, rather than left beside the new report."""
    for folder, _, _ in os.walk(out):
        if not os.access(folder, os.W_OK | os.X_OK):
            raise KvsimError(f"{out}: expected a report kvsim can replace, got the read-only "
                             f"folder {folder}")
    return f"kvsim: replacing {out}, {what}"


def _check_place(out: Path) -> None:
    """``out`` can be created beside its siblings: not inside a file, not in a folder that
    cannot be written, not a name the system refuses. Checked before anything is written."""
    for place in (out, *Path(os.path.abspath(out)).parents):
        try:
            info = os.stat(place)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not there yet (or below a file, found further up)
        except OSError as exc:
            raise KvsimError(f"{out}: expected a usable folder path ({exc.strerror})") from None
        if place == out:
            continue  # check_out judges the folder itself; its parent must be writable
        if not stat.S_ISDIR(info.st_mode):
            raise KvsimError(f"{out}: expected a folder path, got one inside the file {place}")
        if not os.access(place, os.W_OK | os.X_OK):
            raise KvsimError(f"{out}: expected a folder kvsim can write in, got {place} "
                             f"(read-only)")
        return


def _versions() -> dict:
    import matplotlib
    import numba

    return {"kvsim": __version__, "numpy": np.__version__, "numba": numba.__version__,
            "matplotlib": matplotlib.__version__, "python": platform.python_version()}


def git_commit() -> str | None:
    """The last commit that changed kvsim's sources (not HEAD: committing a report must not
    change what its rerun writes), ``+`` marking uncommitted changes; None outside git."""
    root = Path(__file__).resolve().parent.parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
    try:
        commit = git("log", "-1", "--format=%H", "--", "kvsim")[:12]
        dirty = git("status", "--porcelain", "--", "kvsim")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+" if dirty else "")


def _scenario_json(scenario: Scenario) -> dict:
    data = dataclasses.asdict(scenario)
    # Relative to the working directory when below it: reports do not record the machine.
    cwd = Path.cwd().resolve()
    path = scenario.path.resolve()
    data["path"] = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)
    return data


def _write_results(folder: Path, variants: list[Scenario], results: list[ScenarioResults],
                   provenance: markdown.Provenance) -> None:
    with open(folder / "results.csv", "w", newline="") as f:
        write_rows(f, [r for res in results for r in res.rows])
    # zlib level 1: several times faster than savez_compressed's 6, for a little larger file
    write_npz(folder / "steps.npz", steps_arrays([res.steps for res in results]), level=1)
    meta = {"variants": [_scenario_json(v) for v in variants], "versions": _versions(),
            "command": provenance.command, "commit": provenance.commit}
    (folder / "scenario.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")


def _report_context(scenario: Scenario, variants_rows: list[dict]) -> figures.FigureContext:
    """The figures' context of ``scenario`` with one mass scale for the whole report (the
    loss scale when any mass of any variant crowds near 1): its figures compare."""
    exact = {e.name for e in scenario.experiments if e.quantize is None}
    masses = [r["mass_mean"] for r in variants_rows
              if not (r["kind"] == "full" and r["experiment"] in exact)]
    return dataclasses.replace(figures.figure_context(scenario),
                               loss=figures._loss_scale(masses))


def _jobs(folder: Path, variants: list[Scenario], results: list[ScenarioResults],
          ledger: Ledger):
    """Figure jobs (:class:`~kvsim.report.selection.Job`) in report order, and notes on
    requested figures the results cannot support, by key."""
    jobs, notes = [], {}
    every_row = [r for res in results for r in res.rows]
    for i, (scenario, res) in enumerate(zip(variants, results)):
        prefix = f"v{i}_" if len(variants) > 1 else ""
        target = figures.Target(folder, prefix, ledger)
        ctx = _report_context(scenario, every_row)

        def job(key, name, stem, draw, args, rank=None):
            jobs.append(selection.Job(key, name, prefix + stem, draw, args,
                                      selection.RANKS[name] if rank is None else rank))
        job((i, "field"), "field", "field", figures.field_figure, (ctx, res.fields, target))
        job((i, "column_sums"), "column_sums", "column_sums", figures.column_sums,
            (ctx, res.fields, target))
        job((i, "allocation_vs_uniform"), "allocation_vs_uniform", "allocation_vs_uniform",
            figures.allocation_vs_uniform, (ctx, res.rows, target))
        job((i, "mass_vs_bytes"), "mass_vs_bytes", "mass_vs_bytes", bytes_figure.mass_vs_bytes,
            (ctx, res.rows, target))
        job((i, "protocols_vs_per_step"), "protocols_vs_per_step", "protocols_vs_per_step",
            protocol_summary.figure, (ctx, res.rows, target))
        colors = figures.policy_colors(ctx)
        rasters: dict = {}  # what each drawn raster shows: the first experiment showing it
        digests: dict = {}  # each experiment's results, by policy label
        for exp in scenario.experiments:
            rows = [r for r in res.rows if r["experiment"] == exp.name]
            steps = res.steps[exp.name]
            chosen, notes[i, exp.name] = figures.select(ctx, exp, rows)
            digests[exp.name] = selection.experiment_digests(exp, rows, steps)
            same = selection.repeats(digests[exp.name], {k: v for k, v in digests.items()
                                                         if k != exp.name})
            if same:  # every figure would repeat the earlier experiment's
                notes[i, exp.name].append(
                    f"No figure is drawn: every policy of `{exp.name}` gives the same results "
                    f"as in `{same}` (same series and cached positions), whose figures show "
                    f"them.")
                continue
            if figures.kept_raster in [f.draw for f in chosen]:
                first = rasters.setdefault(figures.raster_digest(ctx, exp, steps), exp.name)
                if first != exp.name:  # the same cached positions: one figure, not two
                    chosen = [f for f in chosen if f.draw is not figures.kept_raster]
                    notes[i, exp.name].append(
                        f"`kept_raster` is not drawn: every policy caches the same positions "
                        f"as in `{first}`, whose raster shows them.")
            for fig in chosen:  # figures the scenario names come first, as it orders them
                job((i, exp.name), fig.name, f"{exp.name}_{fig.name}", fig.draw,
                    (ctx, exp, rows, steps, colors, target),
                    0 if exp.figures is not None else None)
            for study in STUDIES:
                if study.applies(scenario, exp):
                    job((i, exp.name, study.name), study.name, f"{exp.name}_{study.name}",
                        study.draw, (ctx, exp, rows, steps, target), selection.RANKS["study"])
    return jobs, notes


def _write_files(folder: Path, variants: list[Scenario], results: list[ScenarioResults],
                 provenance: markdown.Provenance, progress: bool = False) -> None:
    """Draw in this process (one process: a run's peak memory is that of one process,
    which every measure agrees on and ``validate`` bounds)."""
    _write_results(folder, variants, results, provenance)
    ledger = Ledger()
    jobs, notes = _jobs(folder, variants, results, ledger)
    bar = tqdm(total=min(len(jobs), variants[0].max_figures), unit="figure", desc="figures",
               disable=not progress, leave=False, dynamic_ncols=True)
    for job in jobs:  # the bar advances as each drawn job returns
        job.draw = _ticking(job.draw, bar)
    drawn, purposes, left = selection.draw(jobs, variants[0].max_figures)
    bar.close()
    provenance.finish()
    markdown.write(folder, variants, results, drawn, notes, provenance,
                   markdown.FigureNotes(purposes, ledger.repeats, [j.stem for j in left],
                                        variants[0].max_figures))
    (folder / "run.json").write_text(json.dumps(provenance.run_facts(), indent=2) + "\n")


def _ticking(draw, bar):
    def drawn(*args):
        paths = draw(*args)
        bar.update(1)
        return paths
    return drawn


def write_report(out: Path, variants: list[Scenario], results: list[ScenarioResults],
                 force: bool, workers: int = 1,
                 provenance: markdown.Provenance | None = None, progress: bool = False) -> Path:
    """Write the report into a temporary folder, then move it to ``out`` in one rename.

    ``workers``: the run's threads, for its provenance; ``progress``: a bar of the figures
    on stderr. ``out`` is
    replaced only as :func:`check_out` allows; a replacement is announced on stderr.
    """
    note = check_out(out, force, variants[0])
    provenance = provenance or markdown.Provenance.start(None, workers)
    replace_folder(out, lambda tmp: _write_files(tmp, variants, results, provenance, progress))
    if note:
        print(note, file=sys.stderr)
    return out
