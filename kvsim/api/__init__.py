"""The Python API: attention objects, :func:`simulate` over many policies and budgets, and
:class:`Results` (also loaded back from a report folder by :func:`load_report`)."""

from kvsim.api.attention import Attention
from kvsim.api.results import Results, load_report
from kvsim.api.simulate import SimulationResult, simulate

__all__ = ["Attention", "Results", "SimulationResult", "load_report", "simulate"]
