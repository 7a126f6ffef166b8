"""Exceptions kvsim raises for bad input and broken invariants."""


class KvsimError(ValueError):
    """Invalid input: a scenario, an attention matrix or a simulate() argument."""


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
