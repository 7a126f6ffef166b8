"""Every number README.md and docs/*.md quote from a committed report is the report's.

The convention (docs/architecture.md, "Numbers in the docs"): a quoted number is followed,
on the same line, by an HTML comment naming the committed file it comes from, which the
site and GitHub do not show::

    took 845 s<!-- reports/closed_loop_smollm2/report.md "Wall time" -->
    KL 0.368<!-- reports/closed_loop_smollm2/results.csv policy=tova budget=64 kl -->

The comment cites the number just before it (its sign and thousands separators aside):

- a text file (``report.md``): the number must be printed as the page prints it (to the
  same decimals) on a line of that file; a quoted phrase narrows the lines to those that
  contain it;
- a CSV file: ``column`` and any ``key=value`` (or ``key!=value``) filters; the mean of
  that column over the matching rows (``distinct(column)``: the number of its values;
  ``rows``: the number of rows), rounded half up to the page's decimals;
- a JSON file: a dotted key path (list items by index), rounded likewise.

``/N`` and ``*N`` words scale a CSV or JSON value (``/1048576``: bytes to MiB); a ``%``
after the page's number multiplies it by 100.

A page that states a timing or memory figure of a committed report cites it in this way;
one with no committed measurement behind it is not stated.
"""

from __future__ import annotations

import csv
import json
import re
import shlex
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NUMBER = r"[-+\u2212]?\d[\d,]*(?:\.\d+)?"
CITE = re.compile(rf"({NUMBER})(\s*%)?[^\d<]{{0,12}}?<!--\s*(reports/[^\s>]+)(.*?)-->")
ANY_CITE = re.compile(r"<!--\s*reports/")


@dataclass
class Cite:
    """One cited number of a page."""

    page: str
    line: int
    number: str
    percent: bool
    source: str
    locator: str

    def where(self) -> str:
        return f"{self.page}:{self.line}: {self.number} cites {self.source} {self.locator}".strip()


def _plain(number: str) -> str:
    """``number`` without sign and thousands separators."""
    return number.lstrip("+-\u2212").replace(",", "")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def cites(page: Path) -> tuple[list[Cite], list[str]]:
    """Every cited number of ``page``, and each citation that follows no number (a code
    span that opens with ``<!--`` shows the convention and is not read)."""
    found, orphans = [], []
    for i, line in enumerate(page.read_text().splitlines(), 1):
        line = re.sub(r"`<!--[^`]*`", "", line)
        matches = list(CITE.finditer(line))
        if len(matches) != len(ANY_CITE.findall(line)):
            orphans.append(f"{_name(page)}:{i}: a report citation follows no number")
        found += [Cite(_name(page), i, m.group(1), bool(m.group(2)), m.group(3),
                       m.group(4).strip()) for m in matches]
    return found, orphans


def _rounded(value: float, like: str) -> str:
    """``value`` rounded half up to the decimals of the page's number ``like``."""
    places = len(like.split(".")[1]) if "." in like else 0
    return str(Decimal(repr(abs(value))).quantize(Decimal(1).scaleb(-places),
                                                   rounding=ROUND_HALF_UP))


def _check_text(cite: Cite, text: str) -> str | None:
    phrase = shlex.split(cite.locator)[0] if cite.locator else ""
    lines = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if phrase in ln]
    if not lines:
        return f"{cite.where()}: no line of {cite.source} contains {phrase!r}"
    want = Decimal(_plain(cite.number))
    printed = [(abs(Decimal(_plain(n)) - want), n, i, ln) for i, ln in lines
               for n in re.findall(NUMBER, ln)]
    if any(gap == 0 for gap, *_ in printed):
        return None
    if not printed:
        return f"{cite.where()}: no number on the lines of {cite.source} with {phrase!r}"
    _, near, i, ln = min(printed, key=lambda p: p[0])
    return f"{cite.where()}: not printed there; nearest: {near} (its line {i}: {ln.strip()[:160]})"


def _scale(words: list[str], percent: bool) -> float:
    """The factor of the ``/N`` and ``*N`` words (times 100 for a page's ``%``)."""
    factor = 100.0 if percent else 1.0
    for w in words:
        factor = factor / float(w[1:]) if w[0] == "/" else factor * float(w[1:])
    return factor


def _matches(row: dict, test: str) -> bool:
    key, value = test.split("!=", 1) if "!=" in test else test.split("=", 1)
    return (row.get(key) == value) != ("!=" in test)


def _check_csv(cite: Cite, path: Path) -> str | None:
    words = shlex.split(cite.locator)
    tests = [w for w in words if "=" in w]
    scale = [w for w in words if w[0] in "/*"]
    column = [w for w in words if w not in tests and w not in scale]
    if len(column) != 1:
        return f"{cite.where()}: name one column (or rows, distinct(column)) and filters"
    distinct = re.fullmatch(r"distinct\((\w+)\)", column[0])
    name = distinct.group(1) if distinct else column[0]
    with path.open(newline="") as f:
        rows = [r for r in csv.DictReader(f) if all(_matches(r, t) for t in tests)]
    if not rows or (name not in rows[0] and name != "rows"):
        return f"{cite.where()}: no rows with {tests} and column {name!r}"
    if name == "rows":
        value, how = float(len(rows)), "rows"
    elif distinct:
        value, how = float(len({r[name] for r in rows})), f"distinct values in {len(rows)} rows"
    else:
        value, how = sum(float(r[name]) for r in rows) / len(rows), f"mean of {len(rows)} rows"
    value *= _scale(scale, cite.percent)
    got = _rounded(value, _plain(cite.number))
    if got == _plain(cite.number):
        return None
    return f"{cite.where()}: expected {got} ({value:.6g}, {how}), the page says {cite.number}"


def _check_json(cite: Cite, path: Path) -> str | None:
    words = shlex.split(cite.locator)
    value = json.loads(path.read_text())
    for key in words[0].split("."):
        try:
            value = value[int(key)] if isinstance(value, list) else value[key]
        except (KeyError, IndexError, ValueError, TypeError):
            return f"{cite.where()}: no key {key!r} in {cite.source}"
    value = float(value) * _scale(words[1:], cite.percent)
    got = _rounded(value, _plain(cite.number))
    if got == _plain(cite.number):
        return None
    return f"{cite.where()}: expected {got} ({value:.6g}), the page says {cite.number}"


def check(cite: Cite) -> str | None:
    """``None`` if the cited file holds ``cite``'s number, else why not (file:line first)."""
    path = ROOT / cite.source
    if not path.is_file():
        return f"{cite.where()}: {cite.source} is not a committed file"
    if path.suffix == ".csv":
        return _check_csv(cite, path)
    if path.suffix == ".json":
        return _check_json(cite, path)
    return _check_text(cite, path.read_text())


ALL = [c for page in PAGES for c in cites(page)[0]]


def test_citations_follow_numbers():
    orphans = [o for page in PAGES for o in cites(page)[1]]
    assert not orphans, "\n".join(orphans)


def test_pages_cite_reports():
    """The convention is in use where the pages quote the reports' results."""
    cited = {c.page for c in ALL}
    for page in ("README.md", "docs/findings.md", "docs/closed-loop.md", "docs/outputs.md"):
        assert page in cited, f"{page} cites no report number"


def test_cited_numbers_are_the_reports():
    wrong = [why for c in ALL if (why := check(c))]
    assert not wrong, f"{len(wrong)} of {len(ALL)} cited numbers disagree:\n" + "\n".join(wrong)


@pytest.mark.parametrize("line, source", [
    ("took 845 s<!-- reports/closed_loop_smollm2/report.md \"Wall time\" -->", None),
    ("took 36.3 min<!-- reports/closed_loop_smollm2/report.md \"Wall time\" -->", "14.1 min"),
    ("mass 0.567<!-- reports/h2o_online_vs_offline/results.csv policy=h2o_offline budget=128 "
     "experiment=decode mass_mean -->", None),
    ("mass 0.566<!-- reports/h2o_online_vs_offline/results.csv policy=h2o_offline budget=128 "
     "experiment=decode mass_mean -->", "expected 0.567"),
])
def test_checker_reports_the_disagreement(tmp_path: Path, line: str, source: str | None):
    """The checker accepts the report's number and, where the page differs, names the page's
    line and what the report has."""
    page = tmp_path / "page.md"
    page.write_text(f"text\n{line}\n")
    (found,), _ = cites(page)
    why = check(found)
    assert (why is None) if source is None else (why.startswith("page.md:2: ") and source in why)


def test_results_columns_table_names_every_column():
    """docs/outputs.md's table of results.csv columns names every column the committed
    scenario reports write (a policy's ``KIND.PARAM`` columns by that pattern)."""
    text = (ROOT / "docs" / "outputs.md").read_text().split("## The columns of results.csv")[1]
    table = text.split("\n## ")[0]
    named = set(re.findall(r"`([\w.]+)`", table))
    for report in sorted((ROOT / "reports").glob("*/scenario.json")):
        with (report.parent / "results.csv").open(newline="") as f:
            columns = next(csv.reader(f))
        missing = [c for c in columns if c not in named and "." not in c]
        assert not missing, f"docs/outputs.md: results.csv columns not in its table: {missing}"
