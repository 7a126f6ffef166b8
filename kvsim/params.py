"""Typed, checked parameters shared by policies and attention sources.

Every numeric parameter has a range: ``low``/``high`` where given, and always a finite
float or an integer that fits in int64 (kernels index with them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class Param:
    """One parameter: its type, default, allowed values and meaning.

    ``default = None`` means "not given" (the code resolves it, e.g. to the first recorded
    layer); an explicit value must then be valid like any other.
    """

    type: type
    default: Any
    help: str
    choices: tuple = ()
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # how a valid value reads in an error message
    low: float | None = None
    high: float | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not valid for this parameter, or None."""
        if value is None and self.default is None:
            return None
        is_int = isinstance(value, int) and not isinstance(value, bool)
        ok_type = isinstance(value, self.type) and not (
            self.type is not bool and isinstance(value, bool))
        if self.type is float and is_int:
            ok_type = True
        if not ok_type:
            return f"expected {self.type.__name__}, got {value!r}"
        if self.type is float and not math.isfinite(value):
            return f"expected a finite number, got {value!r}"
        if is_int and not -INT64_MAX <= value <= INT64_MAX:
            return f"expected {self.expect or 'an integer'} (within int64), got {value!r}"
        if self.choices and value not in self.choices:
            return f"expected one of {', '.join(map(repr, self.choices))}, got {value!r}"
        if (self.low is not None and value < self.low) or (
                self.high is not None and value > self.high):
            return f"expected {self.expect or self.range_text()}, got {value!r}"
        if self.check is not None and not self.check(value):
            return f"expected {self.expect}, got {value!r}"
        return None

    def range_text(self) -> str:
        """The declared range as words: ``a number in [0, 1e4]``."""
        what = "an integer" if self.type is int else "a number"
        if self.high is None:
            return f"{what} >= {self.low:g}"
        if self.low is None:
            return f"{what} <= {self.high:g}"
        return f"{what} in [{self.low:g}, {self.high:g}]"
