"""Results of :func:`kvsim.simulate` and of report folders: tidy rows plus per-step arrays."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Callable

import numpy as np

from kvsim.errors import KvsimError
from kvsim.attention import files
from kvsim.engine.records import SERIES, parse_steps, read_rows, write_rows

METRICS = ("mass", "cache_size", "recall", "error")
# Series that exist only with some data: the summary column that is nan without it, and what.
MISSING = {"recall": ("final_recall", "ground-truth important tokens (important=...)"),
           "error": ("error_mean", "value vectors (Attention.from_qk, a trace, or a spec "
                                   "with qk values) and decode steps")}


class Results:
    """Tidy rows, one per (experiment, policy, budget, seed, head), and their step series.

    Attributes
    ----------
    rows : list of dict
        The columns of a report's ``results.csv``: ``policy``, ``kind``, ``budget``,
        ``seed``, ``head``, ``kv_head``, ``T``, ``prompt_len``, the policies' parameters,
        and summaries (``mass_mean``, ``mass_min``, ``mass_p10``, ``mass_median``,
        ``kl_mean``, ``kept``, ``compression``, ``recall_mean``, ``final_recall``,
        ``error_mean``, ``error_max``), the memory held per KV head (``peak_size``,
        ``mean_size``, ``effective_ratio`` = peak / T) and the ``protocol``.
    name : str
        ``"simulate"``, or the report folder's name.

    Notes
    -----
    Row ``r``'s step series is row ``r["unit"]`` of its experiment's arrays, read with
    :meth:`series`; :meth:`kept` gives the cache at every step where it was recorded.
    """

    def __init__(self, name: str, rows: list[dict] | Callable[[], list[dict]], arrays: dict,
                 kept: dict | None = None, focus: dict | None = None):
        self.name = name
        self._rows = rows  # or what builds them, on first access (their summaries cost)
        self._arrays = arrays  # (variant, experiment) -> {metric: (units, steps), ...}
        # (variant, experiment) -> (recorded steps, {(label, budget, seed, kv): caches})
        self._kept = kept or {}
        self._focus = focus or {}  # (variant, experiment) -> the budget figures show caches of

    @property
    def rows(self) -> list[dict]:
        """The tidy rows (see the class's attributes), built on first access."""
        if callable(self._rows):
            self._rows = self._rows()
        return self._rows

    def __repr__(self) -> str:
        return (f"Results({self.name!r}: {len(self.rows)} rows, policies {self.policies}, "
                f"budgets {self.budgets})")

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def policies(self) -> list[str]:
        """Policy labels, in row order."""
        return list(dict.fromkeys(r["policy"] for r in self.rows))

    @property
    def budgets(self) -> list[int]:
        """Budgets, ascending."""
        return sorted({r["budget"] for r in self.rows})

    @property
    def experiments(self) -> list[str]:
        return list(dict.fromkeys(r["experiment"] for r in self.rows))

    def select(self, policy: str | None = None, budget: int | None = None, **where) -> list[dict]:
        """Rows matching ``policy``, ``budget`` and any other ``column=value``."""
        if policy is not None:
            where["policy"] = policy
        if budget is not None:
            where["budget"] = budget
        for column in where:
            if self.rows and column not in self.rows[0]:
                raise KvsimError(f"{column}: expected a column of the results "
                                 f"({', '.join(self.rows[0])})")
        return [r for r in self.rows if all(r[c] == v for c, v in where.items())]

    def series(self, metric: str, policy: str | None = None, budget: int | None = None,
               **where) -> np.ndarray:
        """Per-step series of the matching rows, stacked in row order.

        Parameters
        ----------
        metric : {"mass", "cache_size", "recall", "error"}
        policy, budget, **where : filters, as :meth:`select`.

        Returns
        -------
        ndarray, (matching rows, decode steps)
        """
        if metric not in METRICS:
            raise KvsimError(f"metric: expected one of {', '.join(METRICS)}, got {metric!r}")
        rows = self.select(policy, budget, **where)
        if not rows:
            raise KvsimError(f"series: no rows match policy={policy!r}, budget={budget!r}, "
                             f"{where}; policies {self.policies}, budgets {self.budgets}")
        parts = {(r["variant"], r["experiment"]) for r in rows}
        if len(parts) > 1:
            raise KvsimError("series: rows of several experiments match; pass experiment=NAME "
                             "(and variant=LABEL)")
        summary = MISSING.get(metric)
        if summary and all(np.isnan(r[summary[0]]) for r in rows):
            raise KvsimError(f"series: {metric!r} needs {summary[1]}, which the matching rows "
                             f"lack (their {summary[0]} is nan)")
        table = self._arrays[parts.pop()][metric]
        return table[[r["unit"] for r in rows]]

    def mass(self, policy: str | None = None, budget: int | None = None, **where) -> np.ndarray:
        """``series("mass", ...)``: the attention mass kept at each decode step."""
        return self.series("mass", policy, budget, **where)

    def kept(self, policy: str, budget: int, *, seed: int | None = None, kv_head: int = 0,
             experiment: str | None = None) -> np.ndarray:
        """The cached positions at the recorded decode steps, ``(steps, budget)`` padded
        with -1 (:meth:`kept_steps` gives the steps).

        ``kvsim.simulate(..., record=("kept",))`` records every step of every run; a report
        folder holds up to 64 steps of its focus budget.
        """
        rows = self.select(policy, budget, kv_head=kv_head,
                           **({"seed": seed} if seed is not None else {}),
                           **({"experiment": experiment} if experiment is not None else {}))
        if not rows:
            raise KvsimError(f"kept: no run of policy {policy!r} at budget {budget} on KV head "
                             f"{kv_head} (policies {self.policies}, budgets {self.budgets})")
        r = rows[0]
        caches = self._kept.get((r["variant"], r["experiment"]), (None, {}))[1]
        key = (r["policy"], r["budget"], r["seed"], r["kv_head"])
        if key not in caches:
            raise KvsimError(f"kept: not recorded for {policy!r} at budget {budget}; pass "
                             f"record=('kept',) to kvsim.simulate")
        return caches[key]

    def kept_steps(self, experiment: str | None = None) -> np.ndarray:
        """Decode steps (0 = the first) at which :meth:`kept` recorded the caches."""
        return self.part(experiment or self.experiments[0])[2][0]

    def to_csv(self, path: str | Path | None = None) -> str | Path:
        """The rows as CSV: a string, or written to ``path`` (returned)."""
        buffer = io.StringIO()
        write_rows(buffer, self.rows)
        if path is None:
            return buffer.getvalue()
        path = Path(path)
        path.write_text(buffer.getvalue())
        return path

    def to_pandas(self):
        """The rows as a ``pandas.DataFrame`` (needs pandas: ``pip install kvsim[pandas]``)."""
        try:
            import pandas
        except ImportError:
            raise KvsimError("to_pandas: expected pandas to be installed "
                             "(pip install 'kvsim[pandas]')") from None
        return pandas.DataFrame(self.rows)

    def plot(self, figure: str = "mass_vs_budget", out: str | Path | None = None, *,
             experiment: str | None = None, formats: tuple[str, ...] = ("png",),
             dpi: int = 120):
        """Draw one of the report's figures: a matplotlib ``Figure``, or files in ``out``.

        Parameters
        ----------
        figure : {"mass_vs_budget", "mass_over_time", "recall_vs_budget", "pareto", "kept_raster"}
            ``recall_vs_budget`` and ``pareto`` need ground truth; ``kept_raster`` needs
            recorded caches (``record=("kept",)``, or a report folder).
        out : folder to save the figure in (created if needed); default: not saved.
        experiment : which experiment of a report (default: the first).
        formats : any of ``png``, ``svg``, ``pdf`` (with ``out``).

        Returns
        -------
        matplotlib.figure.Figure, or list of Path
            The figure; with ``out``, the files written (the figure is closed).
        """
        from kvsim.api import plots  # matplotlib is imported only when a figure is drawn

        name = experiment or self.experiments[0]
        return plots.draw(self, figure, None if out is None else Path(out), name,
                          tuple(formats), dpi)

    def part(self, experiment: str) -> tuple[list[dict], dict, tuple, int]:
        """Rows, arrays, (recorded steps, caches at the focus budget by (label, seed, kv))
        and focus budget of one experiment (of the first variant holding it)."""
        rows = [r for r in self.rows if r["experiment"] == experiment]
        if not rows:
            raise KvsimError(f"experiment: expected one of {self.experiments}, got {experiment!r}")
        variant = rows[0]["variant"]
        rows = [r for r in rows if r["variant"] == variant]
        key = (variant, experiment)
        budgets = sorted({r["budget"] for r in rows})
        focus = self._focus.get(key) or budgets[len(budgets) // 2]
        steps, caches = self._kept.get(key, (np.zeros(0, np.int64), {}))
        at_focus = {(label, s, kv): v for (label, b, s, kv), v in caches.items() if b == focus}
        return rows, self._arrays[key], (steps, at_focus), focus


def load_report(path: str | Path) -> Results:
    """The :class:`Results` of a report folder written by ``kvsim run`` or :func:`kvsim.run`.

    Parameters
    ----------
    path : the report folder (holding ``results.csv`` and ``steps.npz``).

    Raises
    ------
    KvsimError
        If the folder lacks either file or they do not match.
    """
    folder = Path(path)
    csv_path, npz_path = folder / "results.csv", folder / "steps.npz"
    for p in (csv_path, npz_path):
        if not p.is_file():
            raise KvsimError(f"{p}: expected a report file (results.csv and steps.npz), "
                             f"got no such file")
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            rows = read_rows(f)
    except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
        raise KvsimError(f"{csv_path}: expected results.csv as kvsim writes it ({exc})") \
            from None
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    focus: dict = {}
    if (folder / "scenario.json").is_file():
        try:
            meta = json.loads((folder / "scenario.json").read_text(encoding="utf-8"))
            for i, variant in enumerate(meta.get("variants", [])[:len(variants)]):
                for exp in variant.get("experiments", []):
                    focus[variants[i], exp["name"]] = exp.get("focus_budget")
        except (OSError, UnicodeDecodeError, ValueError, AttributeError, TypeError,
                KeyError) as exc:
            raise KvsimError(f"{folder / 'scenario.json'}: expected scenario.json as kvsim "
                             f"writes it ({type(exc).__name__}: {exc})") from None
    try:
        with np.load(npz_path, allow_pickle=False) as data:
            arrays, kept = parse_steps(data, variants, focus)
    except (*files.READ_ERRORS, IndexError) as exc:
        raise KvsimError(f"{npz_path}: expected steps.npz as kvsim writes it ({exc})") from None
    for (_, experiment), table in arrays.items():
        shapes = {name: table[name].shape for name in SERIES if name in table}
        if len(shapes) < len(SERIES) or len(set(shapes.values())) > 1 \
                or len(shapes["mass"]) != 2:
            raise KvsimError(f"{npz_path}: expected the per-step series {', '.join(SERIES)} "
                             f"of experiment {experiment!r} as (units, decode steps) arrays of "
                             f"one shape, got {shapes}")
    for r in rows:
        table = arrays.get((r["variant"], r["experiment"]), {}).get("mass")
        if table is None or not 0 <= r["unit"] < table.shape[0]:
            raise KvsimError(f"{csv_path}: expected rows whose unit steps.npz holds, got "
                             f"unit {r['unit']} of experiment {r['experiment']!r}")
    return Results(folder.name, rows, arrays, {k: tuple(v) for k, v in kept.items()}, focus)

