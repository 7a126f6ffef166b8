"""kvsim: a fast, exact simulator of KV-cache eviction policies for LLM decoding."""

from kvsim.errors import KvsimError, ScenarioError
from kvsim.policies import POLICIES
from kvsim.report import run
from kvsim.scenario import Scenario, load_scenario, load_sweep
from kvsim.simulation import SimulationResult, simulate

__version__ = "0.1.0"

__all__ = ["POLICIES", "KvsimError", "Scenario", "ScenarioError", "SimulationResult",
           "load_scenario", "load_sweep", "run", "simulate", "__version__"]
