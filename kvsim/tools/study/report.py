"""What every study's report folder shares: its CSV files written and read back exactly,
the settings it saves, and its lines on the run (command, version, machine, model layers,
figures)."""

from __future__ import annotations

import csv
from pathlib import Path


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as a CSV file, the columns of the first row in order (floats by ``repr``:
    :func:`read_csv` gives them back exactly)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path, types: dict, others: type | None = None) -> list[dict]:
    """The rows of a CSV file of :func:`write_csv`, each column parsed by its type in
    ``types`` (column -> type), the other columns by ``others``; without ``others`` the
    columns must be exactly those of ``types``, in order (else ValueError). Written back,
    the rows give the same file."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if others is None and reader.fieldnames != list(types):
            raise ValueError(f"expected the columns {', '.join(types)}")
        return [{k: types.get(k, others)(v) for k, v in r.items()} for r in reader]


def version_lines(facts: dict) -> list[str]:
    """The report's lines naming the command, kvsim's version and commit, and the date."""
    commit = f"commit `{facts['commit']}`" if facts.get("commit") else "no git checkout"
    return [f"- command: `{facts['command']}`",
            f"- kvsim {facts['kvsim']}, {commit}; {facts['date']}"]


def redrawn_lines(facts: dict, files: str, kept: str) -> list[str]:
    """The report's line on a redraw (``facts["redrawn"]``, if any) from its ``files``: the
    command, kvsim's version and commit, the date, and that ``kept`` are the run's."""
    redrawn = facts.get("redrawn")
    if not redrawn:
        return []
    return [f"- figures and text redrawn from {files} by `{redrawn['command']}`, kvsim "
            f"{redrawn['kvsim']}, commit `{redrawn['commit']}`; {redrawn['date']} ({kept} "
            f"are those of the run above)"]


def machine_words(facts: dict, covers: str = "") -> str:
    """The wall time (``covers``: what the command did, in words), cores, worker processes
    and load average of the run."""
    one, _, fifteen = facts["load_average"]
    workers = facts["workers"]
    where = f" of the Dask cluster {facts['dask']}" if facts.get("dask") else ""
    return (f"{facts['wall_seconds']:.0f} s ({facts['wall_seconds'] / 60:.1f} min) for the "
            f"whole command{f' ({covers})' if covers else ''}, on {facts['cores']} cores with "
            f"{workers} worker process{'es' if workers > 1 else ''}{where} (torch on one "
            f"thread each); load average {one:.1f} over the last minute and {fifteen:.1f} over "
            f"15 minutes, at the end")


def figure_lines(figures: list[str]) -> list[str]:
    """The report's section showing its image files among ``figures``."""
    return ["", "## Figures", "", *(f"![{f}]({f})" for f in figures
                                    if f.endswith((".png", ".svg")))]


def settings_of(cfg) -> dict:
    """A study's settings for its JSON file: file paths by name, policies (and kvpress's
    presses) by label."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(cfg).items()
                if k not in ("policies", "path")}
    if isinstance(getattr(cfg, "model", None), Path):  # a study inside a model: its folder
        settings["model"] = cfg.model.name
    settings["policies"] = {p.label: {"kind": p.kind, **p.params} for p in cfg.policies}
    if getattr(cfg, "presses", ()):  # kvpress's, by label: the press and its arguments
        settings["presses"] = {p.label: {"press": p.kind, **p.params} for p in cfg.presses}
    return settings


def layer_words(facts: dict) -> str:
    """The model's layers, global and sliding-window."""
    n, glob = facts["layers"], facts.get("global_layers", range(facts["layers"]))
    if len(glob) == n:
        return f"{n} layers"
    return (f"{n} layers ({len(glob)} global: {', '.join(map(str, glob))}; the others "
            f"sliding-window, window {'/'.join(map(str, facts['windows']))})")


def cache_words(facts: dict) -> str:
    """What holds a cache under the budget."""
    n, glob = facts["layers"], facts.get("global_layers", range(facts["layers"]))
    if len(glob) == n:
        return "Every layer and KV head holds its own cache under the hard budget"
    return ("Every global layer and KV head holds its own cache under the hard budget (budgets "
            "are per global layer); every sliding-window layer keeps exactly its window, as "
            "the stock model does, under every policy")
