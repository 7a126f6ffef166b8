"""Orchestration: expand a scenario into runs, execute them, collect tidy results."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvsim.policies import POLICIES, Group
from kvsim.scenario import Experiment, Scenario
from kvsim.simulation import final_recall, get_policy, make_group, run_budgets

PARAM_COLUMNS = tuple(sorted({name for p in POLICIES.values() for name in p.params}))


@dataclass
class ExperimentSteps:
    """Per-step series of every run of one experiment, one row per results row."""

    mass: list = field(default_factory=list)
    cache_size: list = field(default_factory=list)
    recall: list = field(default_factory=list)
    error: list = field(default_factory=list)
    kept: list = field(default_factory=list)

    def arrays(self) -> dict[str, np.ndarray]:
        """Stacked arrays; ``kept`` padded with -1 to the largest final cache."""
        width = max((k.shape[0] for k in self.kept), default=0)
        kept = np.full((len(self.kept), width), -1, np.int64)
        for i, k in enumerate(self.kept):
            kept[i, :k.shape[0]] = k
        return {"mass": np.array(self.mass, np.float64).reshape(len(self.mass), -1),
                "cache_size": np.array(self.cache_size, np.int64).reshape(len(self.mass), -1),
                "recall": np.array(self.recall, np.float64).reshape(len(self.mass), -1),
                "error": np.array(self.error, np.float64).reshape(len(self.mass), -1),
                "kept": kept}


@dataclass
class ScenarioResults:
    """Everything a run produced: tidy rows and per-step series per experiment."""

    rows: list[dict]
    steps: dict[str, ExperimentSteps]


def random_seed(seed: int, head: int) -> int:
    """Seed of the ``random`` policy for (scenario seed, head): independent streams."""
    return int(np.random.SeedSequence([seed, head]).generate_state(1, np.uint64)[0])


def _summary(mass: np.ndarray, recall: np.ndarray, error: np.ndarray, kept: np.ndarray,
             important: np.ndarray, has_truth: bool, T: int) -> dict:
    nan = float("nan")
    stats = {"mass_mean": nan, "mass_min": nan, "mass_p10": nan, "mass_median": nan,
             "kl_mean": nan}
    if mass.size:
        stats.update(mass_mean=float(mass.mean()), mass_min=float(mass.min()),
                     mass_p10=float(np.quantile(mass, 0.1)),
                     mass_median=float(np.median(mass)),
                     kl_mean=float(np.mean(-np.log(np.maximum(mass, 1e-300)))))
    stats["kept"] = int(kept.shape[0])
    stats["compression"] = 1.0 - kept.shape[0] / T
    defined = recall[~np.isnan(recall)]
    stats["recall_mean"] = float(defined.mean()) if has_truth and defined.size else nan
    stats["final_recall"] = final_recall(kept, important) if has_truth else nan
    defined = error[~np.isnan(error)]
    stats["error_mean"] = float(defined.mean()) if defined.size else nan
    stats["error_max"] = float(defined.max()) if defined.size else nan
    return stats


def count_runs(scenario: Scenario) -> int:
    """Number of (experiment, policy, budget, seed, head) runs in ``scenario``."""
    return sum(len(e.policies) * len(e.budgets) for e in scenario.experiments) \
        * len(scenario.seeds) * scenario.heads


def simulate_scenario(scenario: Scenario, *, progress: bool = True,
                      workers: int | None = None) -> ScenarioResults:
    """Run every experiment x policy x budget x seed x head of ``scenario``.

    The policies of one KV head run on ``workers`` threads (default: every core); the
    kernels release the GIL, and results do not depend on the number of workers.
    """
    workers = workers or os.cpu_count() or 1
    rows: list[dict] = []
    steps = {e.name: ExperimentSteps() for e in scenario.experiments}
    bar = tqdm(total=count_runs(scenario), unit="run", disable=not progress, dynamic_ncols=True,
               desc=scenario.name)
    with bar:
        for seed in scenario.seeds:
            sequence = scenario.field(seed)
            passes: dict = {}
            for kv in range(scenario.kv_heads):
                for exp in scenario.experiments:
                    group = make_group(sequence.data, kv, exp.prompt_len, sequence.mask, passes,
                                       scenario.gqa_mode, random_seed(seed, kv))
                    _run_experiment(scenario, exp, group, seed, kv, rows, steps[exp.name], bar,
                                    workers)
    return ScenarioResults(rows, steps)


def _run_experiment(scenario: Scenario, exp: Experiment, group: Group, seed: int, kv: int,
                    rows: list[dict], steps: ExperimentSteps, bar: tqdm, workers: int) -> None:
    def run(config):
        traces = run_budgets(get_policy(config.kind), group, list(exp.budgets), config.params)
        bar.update(len(group.heads) * len(traces))
        return traces

    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(run, exp.policies))  # in policy order, whatever finishes first
    for config, traces in zip(exp.policies, results):
        for budget, spec, trace in zip(exp.budgets, exp.budget_specs, traces):
            for g, h in enumerate(group.heads):
                row = {"experiment": exp.name, "unit": len(steps.mass), "policy": config.label,
                       "kind": config.kind, "budget": budget, "budget_spec": spec,
                       "seed": seed, "head": int(h), "kv_head": kv, "T": group.T,
                       "prompt_len": group.prompt_len, "steps": group.T - group.prompt_len}
                row.update({name: config.params.get(name, "") for name in PARAM_COLUMNS})
                row.update(_summary(trace.mass[g], trace.recall[g], trace.error[g], trace.kept,
                                    group.important[g], scenario.has_truth, group.T))
                rows.append(row)
                steps.mass.append(trace.mass[g])
                steps.cache_size.append(trace.cache_size)
                steps.recall.append(trace.recall[g] if scenario.has_truth
                                    else np.full(trace.mass.shape[1], math.nan))
                steps.error.append(trace.error[g])
                steps.kept.append(trace.kept)
