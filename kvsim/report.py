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

from kvsim import figures
from kvsim.engine import ScenarioResults, simulate_scenario
from kvsim.errors import KvsimError
from kvsim.scenario import Scenario, load_scenario


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
    data["path"] = str(scenario.path)
    return {"scenario": data, "versions": _versions()}


def _write_files(folder: Path, scenario: Scenario, results: ScenarioResults) -> None:
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(results.rows[0]))
        writer.writeheader()
        writer.writerows(results.rows)
    arrays = {f"{exp}/{name}": value for exp, steps in results.steps.items()
              for name, value in steps.arrays().items()}
    np.savez_compressed(folder / "steps.npz", **arrays)
    (folder / "scenario.json").write_text(json.dumps(_scenario_json(scenario), indent=2) + "\n")
    for exp in scenario.experiments:
        rows = [r for r in results.rows if r["experiment"] == exp.name]
        figures.draw(scenario, exp, rows, results.steps[exp.name].arrays(), folder)


def write_report(out: Path, scenario: Scenario, results: ScenarioResults, force: bool) -> Path:
    """Write the report into a temporary folder, then move it to ``out`` in one rename."""
    check_out(out, force)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        _write_files(tmp, scenario, results)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out


def run(scenario: Scenario | str | Path, out: str | Path | None = None, *, force: bool = False,
        progress: bool = False, workers: int | None = None) -> Path:
    """Run every experiment of a scenario and write its report folder.

    Parameters
    ----------
    scenario : a :class:`Scenario` or the path of a scenario file.
    out : report folder (default ``reports/<scenario name>``).
    force : replace an existing report folder.
    progress : show a progress bar on stderr.
    workers : threads running policies in parallel (default: every core).

    Returns
    -------
    Path of the report folder.
    """
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario)
    out = Path(out) if out is not None else default_out(scenario)
    check_out(out, force)
    results = simulate_scenario(scenario, progress=progress, workers=workers)
    return write_report(out, scenario, results, force)
