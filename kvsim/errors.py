"""Exceptions kvsim raises for bad input and broken invariants."""

from __future__ import annotations

from typing import NamedTuple


class Problem(NamedTuple):
    """One problem with one key: ``key`` is its path (``"window"``, ``"path"``), or ""."""

    key: str
    message: str


class KvsimError(ValueError):
    """Invalid input: a scenario, an attention matrix or a simulate() argument.

    ``key`` is the path of the offending key or argument where there is one (relative
    to the table being read, e.g. ``"path"`` for a source), ``message`` what was
    expected; ``str(error)`` is ``"key: message"``.
    """

    def __init__(self, message: str, key: str = ""):
        self.key = key
        self.message = message
        super().__init__(f"{key}: {message}" if key else message)


class ScenarioError(KvsimError):
    """One or more problems in a scenario file, each reported as one line.

    Parameters
    ----------
    problems : list of (file, key_path, message)
    """

    def __init__(self, problems: list[tuple[str, str, str]]):
        self.problems = problems
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        return [f"{f}: {k}: {m}" if k else f"{f}: {m}" for f, k, m in self.problems]


class InvariantError(AssertionError):
    """A simulation broke an invariant (budget, mass range): a bug in kvsim."""
