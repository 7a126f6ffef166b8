"""Write a run's report folder atomically: results.csv, steps.npz, scenario.json, figures."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import platform
import shutil
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvsim import figures, h2o_study, markdown
from kvsim.engine import ScenarioResults, count_runs, simulate_scenario
from kvsim.errors import KvsimError
from kvsim.overrides import Overrides
from kvsim.scenario import Scenario, load_sweep
from kvsim.units import UnitStore


def default_out(scenario: Scenario) -> Path:
    """``reports/<scenario name>`` under the working directory."""
    return Path("reports") / scenario.name


def check_out(out: Path, force: bool) -> None:
    """Refuse to replace an existing report unless ``force``."""
    if out.exists() and not force:
        raise KvsimError(f"{out}: expected a new output folder, got an existing one "
                         f"(use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise KvsimError(f"{out}: expected a folder, got a file")


def _versions() -> dict:
    import matplotlib
    import numba

    from kvsim import __version__
    return {"kvsim": __version__, "numpy": np.__version__, "numba": numba.__version__,
            "matplotlib": matplotlib.__version__, "python": platform.python_version()}


def _scenario_json(scenario: Scenario) -> dict:
    data = dataclasses.asdict(scenario)
    # Relative to the working directory when below it: reports do not record the machine.
    cwd = Path.cwd().resolve()
    path = scenario.path
    data["path"] = str(path.relative_to(cwd)) if path.is_relative_to(cwd) else str(path)
    return data


def _write_files(folder: Path, variants: list[Scenario], results: list[ScenarioResults]) -> None:
    rows = [r for res in results for r in res.rows]
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    arrays = {}
    for i, res in enumerate(results):
        prefix = f"v{i}/" if len(variants) > 1 else ""
        for exp, steps in res.steps.items():
            arrays.update({f"{prefix}{exp}/{name}": value
                           for name, value in steps.arrays().items()})
            for (label, seed, kv), snaps in steps.snapshots.items():
                arrays[f"{prefix}{exp}/snapshots/{label}/seed{seed}/kv{kv}"] = snaps
    np.savez_compressed(folder / "steps.npz", **arrays)
    meta = {"variants": [_scenario_json(v) for v in variants], "versions": _versions()}
    (folder / "scenario.json").write_text(json.dumps(meta, indent=2, default=str) + "\n")
    drawn: dict = {}
    for i, (scenario, res) in enumerate(zip(variants, results)):
        target = figures.Target(folder, f"v{i}_" if len(variants) > 1 else "")
        drawn[i, "field"] = figures.field_figures(scenario, res.fields, target)
        for exp in scenario.experiments:
            rows = [r for r in res.rows if r["experiment"] == exp.name]
            steps = res.steps[exp.name]
            drawn[i, exp.name] = figures.draw(scenario, exp, rows, steps, target)
            if h2o_study.applies(exp) and exp.prompt_len < scenario.T:
                drawn[i, exp.name, "h2o"] = h2o_study.figures(scenario, exp, rows, steps, target)
    markdown.write(folder, variants, results, drawn)


def write_report(out: Path, variants: list[Scenario], results: list[ScenarioResults],
                 force: bool) -> Path:
    """Write the report into a temporary folder, then move it to ``out`` in one rename."""
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, variants, results)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def run(scenario: Scenario | list[Scenario] | str | Path, out: str | Path | None = None, *,
        force: bool = False, progress: bool = False, workers: int | None = None,
        resume: bool = False, overrides: Overrides | None = None) -> Path:
    """Run every experiment of a scenario (every variant of its sweep) and write the report.

    Parameters
    ----------
    scenario : a :class:`Scenario`, a list of sweep variants, or a scenario file's path.
    out : report folder (default ``reports/<scenario name>``).
    force : replace an existing report folder.
    progress : show a progress bar on stderr.
    workers : threads running policies in parallel (default: every core).
    resume : reuse the units an interrupted run of the same report already finished.
    overrides : command-line changes applied to a scenario file before validation.

    Returns
    -------
    Path of the report folder.
    """
    if isinstance(scenario, Scenario):
        variants = [scenario]
    elif isinstance(scenario, list):
        variants = scenario
    else:
        variants = load_sweep(scenario, overrides)
    out = Path(out) if out is not None else default_out(variants[0])
    check_out(out, force)
    store = UnitStore(out.parent / f".{out.name}.units", resume)
    total = sum(count_runs(v) for v in variants)
    with tqdm(total=total, unit="run", disable=not progress, dynamic_ncols=True,
              desc=variants[0].name) as bar:
        results = [simulate_scenario(v, workers=workers, store=store, bar=bar) for v in variants]
    write_report(out, variants, results, force)
    shutil.rmtree(store.folder, ignore_errors=True)  # finished: nothing left to resume
    return out
