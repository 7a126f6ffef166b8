"""Orchestration: expand a scenario into runs, execute them, collect tidy results."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvsim.numerics import kernels
from kvsim.numerics.jit import cache_is_warm
from kvsim.scenario.load import Experiment, Scenario
from kvsim.protocols.run import get_policy, make_group, run_budgets, run_capped
from kvsim.engine.allocation import cake_preferences, layer_caps
from kvsim.engine.records import ExperimentSteps, bytes_columns, result_row
from kvsim.engine.storage import run_quantised
from kvsim.engine.resume import UnitStore, unit_key

COMPILING = "compiling kernels (first run only)"
SNAPSHOTS = 64  # cache snapshots per run at the focus budget (kept-position rasters)
HEATMAP_ROWS = 256  # rows of the field heatmap
HEATMAP_BINS = 512  # key bins of the field heatmap (max over each bin)


@dataclass
class FieldSample:
    """What the field figures show of one head (first seed)."""

    colsum: np.ndarray   # (T,) attention each key receives from all queries
    rows: np.ndarray     # (R,) query positions of the heatmap
    heatmap: np.ndarray  # (R, bins) max attention per key bin
    bin_width: int


@dataclass
class ScenarioResults:
    """Everything a run produced: tidy rows, per-step series, field samples."""

    rows: list[dict]
    steps: dict[str, ExperimentSteps]
    fields: list[FieldSample] = field(default_factory=list)


def random_seed(seed: int, head: int, layer: int = 0) -> int:
    """Seed of the ``random`` policy for (scenario seed, head, layer's place in the run):
    independent streams; the first layer's are those of a one-layer run."""
    key = [seed, head] + ([layer] if layer else [])
    return int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0])


def count_runs(scenario: Scenario) -> int:
    """Number of (experiment, policy, budget, seed, layer, head) runs in ``scenario``."""
    return sum(len(e.policies) * len(e.budgets) for e in scenario.experiments) \
        * len(scenario.seeds) * len(scenario.layers) * scenario.heads


def snap_steps(exp: Experiment, T: int) -> np.ndarray:
    steps = T - exp.prompt_len
    return np.unique(np.linspace(0, steps - 1, min(SNAPSHOTS, steps)).astype(np.int64)) \
        if steps > 0 else np.zeros(0, np.int64)


def simulate_scenario(scenario: Scenario, *, progress: bool = True, workers: int | None = None,
                      store: UnitStore | None = None, bar: tqdm | None = None,
                      known_passes: dict | None = None) -> ScenarioResults:
    """Run every experiment x policy x budget x seed x head of ``scenario``.

    The policies of one KV head run on ``workers`` threads (default: every core); the
    kernels release the GIL, and results do not depend on the number of workers. With a
    ``store``, finished units are saved (and reused when it resumes). ``known_passes``
    holds full passes computed elsewhere, by seed (the Dask path ships the first seed's).
    """
    workers = workers or os.cpu_count() or 1
    rows: list[dict] = []
    steps = {e.name: ExperimentSteps(snap_steps=snap_steps(e, scenario.T))
             for e in scenario.experiments}
    own_bar = bar is None
    bar = bar or tqdm(total=count_runs(scenario), unit="run", disable=not progress,
                      dynamic_ncols=True, desc=scenario.name)
    fields: list[FieldSample] = []
    compiling = _compile_phase(bar)
    try:
        for seed in scenario.seeds:
            preferences = {e.name: cake_preferences(
                (scenario.field(seed, layer).data for layer in scenario.layers),
                e.prompt_len, e.tau1, e.tau2) for e in scenario.experiments
                if e.allocation == "cake"}
            for place, layer in enumerate(scenario.layers):
                # O(T) arrays; the full passes come on demand
                sequence = scenario.field(seed, layer)
                passes: dict = dict((known_passes or {}).get(seed, {})) if place == 0 else {}

                def group_for(exp, kv, place=place, sequence=sequence, passes=passes):
                    return head_group(scenario, sequence, passes, seed, kv, exp,
                                      steps[exp.name].snap_steps, progress, place)
                caps = {exp.name: layer_caps(scenario, exp, group_for, place,
                                             preferences.get(exp.name))
                        for exp in scenario.experiments}
                for kv in range(scenario.kv_heads):
                    dims = (sequence.data.keys.shape[1], sequence.data.values.shape[2]
                            if sequence.data.has_values(kv) else 0)
                    for exp in scenario.experiments:
                        _run_experiment(scenario, exp, lambda exp=exp, kv=kv: group_for(exp, kv),
                                        sequence.mask, seed, kv, rows, steps[exp.name], bar,
                                        workers, store, layer, caps[exp.name], dims)
                if compiling:  # every kernel of the scenario has run once: ETAs from now on
                    compiling = _end_compile_phase(bar, scenario.name)
                if seed == scenario.seeds[0] and place == 0:
                    fields = _field_samples(scenario, sequence, passes)
    finally:
        if own_bar:
            bar.close()
    return ScenarioResults(rows, steps, fields)


def head_group(scenario: Scenario, sequence, passes: dict, seed: int, kv: int,
               exp: Experiment, snap_steps: np.ndarray, progress: bool = False,
               place: int = 0):
    """The group of KV head ``kv`` of sequence ``seed`` for ``exp`` (passes memoised) in the
    layer at ``place`` among the layers run jointly; with ``progress``, a long full pass
    shows its rows on stderr. Cache rasters record the first layer only."""
    return make_group(sequence.data, kv, exp.prompt_len, sequence.mask, passes,
                      scenario.gqa_mode, random_seed(seed, kv, place),
                      exp.focus_budget if place == 0 else -1, snap_steps, progress)


def unit_keys(scenario: Scenario, exp: Experiment, seed: int, kv: int,
              snap_steps: np.ndarray, layer: int, caps: np.ndarray) -> list[str]:
    """Resume-store keys of the units (one per policy) of ``exp`` on one seed, layer and
    KV head; ``caps[i, j, kv]`` is policy ``i``'s cap at budget ``j``."""
    storage = {"quantize": vars(exp.quantize)} if exp.quantize else {}
    return [unit_key(source=scenario.source, attention=scenario.attention, T=scenario.T,
                     heads=scenario.heads, kv_heads=scenario.kv_heads, gqa=scenario.gqa,
                     seed=seed, kv=kv, prompt_len=exp.prompt_len, kind=c.kind, params=c.params,
                     budgets=exp.budgets, focus=exp.focus_budget, snaps=snap_steps.tolist(),
                     layer=layer, caps=caps[i, :, kv].tolist(), **storage)
            for i, c in enumerate(exp.policies)]


def _compile_phase(bar: tqdm) -> bool:
    """With a cold kernel cache, label the bar's first units as compilation, without an
    ETA (extrapolating from compilation would be wrong by orders of magnitude)."""
    if bar.disable or cache_is_warm() or bar.n:
        return False
    bar.set_description_str(COMPILING, refresh=False)
    bar.bar_format = "{desc}: {n_fmt}/{total_fmt} {unit}s [{elapsed}]"
    bar.refresh()
    return True


def _end_compile_phase(bar: tqdm, name: str) -> bool:
    """Back to the normal bar, its rate and ETA measured from here."""
    done = bar.n
    bar.bar_format = None
    bar.set_description_str(name, refresh=False)
    bar.reset(bar.total)
    bar.initial = bar.n = bar.last_print_n = done
    bar.refresh()
    return False


def _field_samples(scenario: Scenario, sequence, passes: dict) -> list[FieldSample]:
    """Column sums and a heatmap window of every query head (first experiment's prompt)."""
    P = scenario.experiments[0].prompt_len
    T = scenario.T
    lo = max(0, min(P - HEATMAP_ROWS // 2, T - HEATMAP_ROWS))
    rows = np.arange(lo, min(T, lo + HEATMAP_ROWS))
    width = -(-T // HEATMAP_BINS)
    samples = []
    for kv in range(scenario.kv_heads):
        group = make_group(sequence.data, kv, P, sequence.mask, passes, scenario.gqa_mode)
        for g, h in enumerate(group.heads):
            fp = group.passes()[g]
            heat = np.zeros((rows.size, -(-T // width)))
            for i, q in enumerate(rows):
                row = kernels.row_sums(group.field, group.row_max, group.row_sum, int(h), q, q + 1)
                padded = np.zeros(heat.shape[1] * width)
                padded[:T] = row
                heat[i] = padded.reshape(-1, width).max(axis=1)
            samples.append(FieldSample(fp.prompt_colsum + fp.decode_colsum, rows, heat, width))
    return samples


def _run_experiment(scenario: Scenario, exp: Experiment, group_for, truth: np.ndarray,
                    seed: int, kv: int, rows: list[dict], steps: ExperimentSteps, bar: tqdm,
                    workers: int, store: UnitStore | None, layer: int,
                    caps: np.ndarray, dims: tuple[int, int]) -> None:
    """Every policy of ``exp`` on KV head ``kv`` of one layer; ``caps[i, j, kv]`` is the
    cap of policy ``i`` at budget ``j``; ``dims`` the key and value sizes (0: none)."""
    heads_per_kv = scenario.heads // scenario.kv_heads
    keys = unit_keys(scenario, exp, seed, kv, steps.snap_steps, layer, caps)
    stored = [store.load(k) if store else None for k in keys]
    group = group_for() if any(s is None for s in stored) else None

    def run(i):
        if stored[i] is not None:
            traces = stored[i]
        else:
            config = exp.policies[i]
            policy = get_policy(config.kind)
            source = f"the {scenario.source!r} attention source"
            uniform = exp.allocation == "uniform" or not policy.budgeted
            if exp.quantize is not None:
                traces = [run_quantised(policy, group, budget, None if uniform else int(cap),
                                        config.params, budget == exp.focus_budget, source,
                                        exp.quantize)
                          for budget, cap in zip(exp.budgets, caps[i, :, kv])]
            elif uniform:
                traces = run_budgets(policy, group, list(exp.budgets), config.params, source)
            else:
                traces = [run_capped(policy, group, int(cap), budget, config.params,
                                     budget == exp.focus_budget, source)
                          for budget, cap in zip(exp.budgets, caps[i, :, kv])]
            if store:
                store.save(keys[i], traces)
        bar.update(heads_per_kv * len(traces))
        return traces

    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        results = list(pool.map(run, range(len(exp.policies))))  # in policy order
    except BaseException:  # interrupted: do not wait for the policies still running
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    heads = range(kv * heads_per_kv, (kv + 1) * heads_per_kv)
    for i, (config, traces) in enumerate(zip(exp.policies, results)):
        for j, (budget, spec, trace) in enumerate(zip(exp.budgets, exp.budget_specs, traces)):
            if budget == exp.focus_budget and trace.snapshots.size:
                steps.snapshots[config.label, seed, kv] = trace.snapshots
            for g, h in enumerate(heads):
                ident = {"variant": scenario.variant_label, "experiment": exp.name,
                         "unit": len(steps.mass), "policy": config.label,
                         "kind": config.kind, "budget": budget, "budget_spec": spec,
                         "allocation": exp.allocation, "b_h": int(caps[i, j, kv]),
                         "seed": seed, "layer": layer, "head": h, "kv_head": kv,
                         "T": scenario.T, "prompt_len": exp.prompt_len,
                         "steps": scenario.T - exp.prompt_len}
                rows.append(result_row(ident, config.kind, config.params, trace, g, truth[h],
                                       scenario.has_truth, scenario.T))
                rows[-1].update(bytes_columns(trace.cache_size, *dims, exp.quantize))
                steps.add(trace, g, scenario.has_truth)
