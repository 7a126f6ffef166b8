"""The column order of a report's ``results.csv`` (and of ``Results.rows``): a module of
its own, so that the Python API reads results without importing matplotlib."""

from __future__ import annotations


def result_columns(rows: list[dict]) -> list[str]:
    """Every row's columns: the identifying ones (up to ``steps``), the policy parameters
    (``kind.name``, sorted), then the summaries."""
    seen = list(dict.fromkeys(k for r in rows for k in r))
    params = sorted(k for k in seen if "." in k)
    rest = [k for k in seen if "." not in k]
    cut = rest.index("steps") + 1
    return rest[:cut] + params + rest[cut:]


SIGNIFICANT_DIGITS = 12


def csv_row(row: dict) -> dict:
    """``row`` as ``results.csv`` writes it: floats rounded to 12 significant digits (then
    written as the shortest text that reads back as that float), so that a rerun on
    another CPU, whose last bits of a sum may differ, writes the same file; the
    per-step arrays of ``steps.npz`` stay exact."""
    return {k: repr(float(format(v, f".{SIGNIFICANT_DIGITS}g"))) if isinstance(v, float) else v
            for k, v in row.items()}
