"""Typed, checked parameters shared by policies and attention sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Param:
    """One policy parameter: its type, default, allowed values and meaning."""

    type: type
    default: Any
    help: str
    choices: tuple = ()
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # how a valid value reads in an error message

    def problem(self, value: Any) -> str | None:
        """Why ``value`` is not valid for this parameter, or None."""
        ok_type = isinstance(value, self.type) and not (
            self.type is not bool and isinstance(value, bool))
        if self.type is float and isinstance(value, int) and not isinstance(value, bool):
            ok_type = True
        if not ok_type:
            return f"expected {self.type.__name__}, got {value!r}"
        if self.choices and value not in self.choices:
            return f"expected one of {', '.join(map(repr, self.choices))}, got {value!r}"
        if self.check is not None and not self.check(value):
            return f"expected {self.expect}, got {value!r}"
        return None
