"""kvsim: a fast, exact simulator of KV-cache eviction policies for LLM decoding.

The package is layered; each layer imports only from the layers above it in this list:

- ``errors``, ``params``, ``resources``: the shared vocabulary (errors with key paths,
  parameter schemas with ranges, the memory limit);
- ``numerics``: Numba kernels (elementary functions, noise, fields, full pass, decode);
- ``attention`` and ``policies``: attention sources and the eviction policies on them;
- ``scenario``: TOML -> validated, frozen scenario;
- ``engine``: the cost of a run, experiments expanded into units, run in parallel, resumable;
- ``report``: report folder (owned by one run at a time), markdown and figures;
- ``api``, ``cli``, ``tools``: the Python API (attention objects, simulate, results), the
  command line, bench and capture.
"""

from kvsim._version import __version__
from kvsim.api import Attention, Results, SimulationResult, load_report, simulate
from kvsim.errors import KvsimError, ScenarioError
from kvsim.policies import POLICIES
from kvsim.scenario.load import Scenario, load_scenario, load_sweep


def __getattr__(name: str):
    """``kvsim.run``, imported on first use: the report writer brings matplotlib, which
    the simulation API does not need (``import kvsim`` stays fast)."""
    if name == "run":
        from kvsim.api.run import run
        return run
    raise AttributeError(f"module 'kvsim' has no attribute {name!r}")


__all__ = ["POLICIES", "Attention", "KvsimError", "Results", "Scenario", "ScenarioError",
           "SimulationResult", "load_report", "load_scenario", "load_sweep", "run", "simulate",
           "__version__"]
