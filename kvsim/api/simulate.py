""":func:`simulate`: many policies x budgets x heads x seeds on one attention, in one call."""

from __future__ import annotations

import functools
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from kvsim.api import arguments
from kvsim.api.attention import Attention
from kvsim.api.results import Results
from kvsim.engine.experiments import random_seed
from kvsim.engine.records import ExperimentSteps, result_row
from kvsim.errors import KvsimError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.policies import POLICIES
from kvsim.protocols.settings import PROTOCOL_PARAMS
from kvsim.protocols.run import (final_recall, get_policy, make_group, resolve_params,
                                run_budgets, run_problems)
from kvsim.resources import size_text
from kvsim.scenario.load import PolicyConfig

RECORDABLE = ("kept",)


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of the single-run call ``simulate(matrix, policy, budget, prompt_len)``.

    Attributes
    ----------
    mass : float64 array, one per decode step: full-attention mass the cache keeps.
    cache_size : int64 array, one per decode step: ``|C_t|``.
    kept : int64 array, sorted: the final cache (the prefill selection if ``P = T``).
    recall : float64 array per decode step, or None without ground truth (NaN
        while no important key has arrived).
    final_recall : share of important keys in ``kept``, or None without ground truth.
    """

    policy: str
    budget: int
    prompt_len: int
    params: dict
    mass: np.ndarray
    cache_size: np.ndarray
    kept: np.ndarray
    recall: np.ndarray | None
    final_recall: float | None

    def __repr__(self) -> str:
        steps = len(self.mass)
        mass = f", mean mass {float(np.mean(self.mass)):.4g}" if steps else ""
        recall = "" if self.final_recall is None else f", final recall {self.final_recall:.4g}"
        return (f"SimulationResult({self.policy}, budget {self.budget}, prompt_len "
                f"{self.prompt_len}: {steps} decode steps{mass}, {len(self.kept)} kept{recall})")


def simulate(attention, policy: str | None = None, budget: int | None = None,
             prompt_len: int | None = None, *, policies=None, budgets=None, seeds=None,
             seed: int | None = None, important=None, record: tuple[str, ...] = (),
             workers: int | None = None, check: bool = True, **params):
    """Simulate eviction policies on causal attention.

    Two forms. ``simulate(att, policies=[...], budgets=[...], prompt_len=P)`` runs every
    policy at every budget on every head (and seed) in one call, sharing the full
    passes, on a thread pool, and returns :class:`Results`. The single-run form
    ``simulate(matrix, "h2o", 64, P)`` returns a :class:`SimulationResult`.

    Parameters
    ----------
    attention : Attention or array_like
        An :class:`Attention` (checked once, reused across calls), or causal
        probabilities ``(T, T)`` / ``(H, T, T)`` in float16, float32 or float64 (checked
        at each call unless ``check=False``; a float64 C-contiguous array is read in
        place, not copied).
    policy, budget : str, int
        The single-run form: one registered policy at one budget.
    prompt_len : int
        Prompt length ``P`` in ``[0, T]``; steps ``P .. T-1`` are decoded one by one.
    policies : list of str, or dict
        Policy names, or ``{label: {"kind": name, param: value, ...}}`` as in a scenario's
        ``[policies]`` tables (several configurations of one policy under distinct labels).
    budgets : list of int or float
        Distinct cache budgets in tokens (each at least the policy's fixed parts + 1); as
        in a scenario file, a number in (0, 1] that is not an integer is a fraction of the
        prompt, rounded half up.
    seeds : list of int, optional
        Sequences to simulate (default ``[0]``): the seed of a field spec's random terms
        and of the ``random`` policy. ``seed`` gives one.
    important : array_like of int, optional
        Ground-truth important positions (for recall) when ``attention`` is an array.
    record : tuple of str
        ``("kept",)`` keeps the cache at every decode step (see :meth:`Results.kept`): 8
        bytes per decode step and cached key of every run, and each budget then runs on
        its own (several times slower); a :class:`RecordCostWarning` says how much.
    workers : int, optional
        Threads running policies (default: every core); results do not depend on it.
    check : bool
        Check an array input (``False``: trust it, like ``scipy.linalg``'s
        ``check_finite=False``).
    **params
        Policy parameters (e.g. ``recent_ratio=0.25``), given to every selected policy
        that has them; a parameter no selected policy has is an error.

    Returns
    -------
    Results, or SimulationResult for the single-run form.

    Raises
    ------
    KvsimError
        For any invalid argument, with a one-line message naming it.

    Examples
    --------
    >>> att = kvsim.Attention.from_probs(A)
    >>> res = kvsim.simulate(att, policies=["h2o", "snapkv"], budgets=[64, 256], prompt_len=512)
    >>> res.mass("h2o", 64).mean()
    """
    single = policies is None and budgets is None
    if single and (policy is not None or budget is not None or seeds is None):
        return _single(attention, policy, budget, prompt_len, important, seed, check, record,
                       workers, seeds, params)
    if policy is not None or budget is not None:
        raise KvsimError("policy/budget: expected either policy=..., budget=... (one run) or "
                         "policies=[...], budgets=[...], not both")
    att = _attention(attention, important, check)
    P = _prompt_len(prompt_len, att.T)
    configs = _configs(policies, params)
    caps = _capacities(configs, arguments.budgets(budgets, P), att.T, P)
    seeds = arguments.seeds(seeds, seed)
    record = _record(record)
    if "kept" in record:
        _warn_record_cost(att, P, caps, len(seeds))
    run = _Run(att, P, configs, caps, seeds, record, arguments.workers(workers), random_seed)
    return run.results()


class RecordCostWarning(UserWarning):
    """``record=("kept",)`` keeps every decode step's cache: memory and time."""


_WARNED: set[str] = set()  # each distinct estimate is said once per process


def _warn_record_cost(att: Attention, P: int, caps: dict, seeds: int) -> None:
    """Warn, once per estimate, what recording the caches costs: int64 positions for every
    decode step and cached key (``T`` wide for ``full``), per run, as the CLI's cost
    estimate counts bytes; and each budget's run then goes alone."""
    slots = sum(cap for pairs in caps.values() for _, cap in pairs)
    nbytes = 8.0 * (att.T - P) * slots * seeds * att.kv_heads
    message = (f"record=('kept',) keeps the cache at every decode step: about "
               f"{size_text(nbytes)} for this call ({att.T - P} steps x the budget, per "
               f"policy, budget, seed and KV head), and each budget runs on its own")
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, RecordCostWarning, stacklevel=3)


def _single(attention, policy, budget, prompt_len, important, seed, check, record, workers,
            seeds, params) -> SimulationResult:
    """Today's one-policy, one-budget call on a (T, T) matrix."""
    if seeds is not None or record or workers is not None:
        raise KvsimError("seeds, record, workers: expected only with policies=[...], "
                         "budgets=[...]")
    if not isinstance(policy, str):
        raise KvsimError(f"policy: expected a policy name ({', '.join(POLICIES)}), "
                         f"got {policy!r}")
    if budget is None:
        raise KvsimError("budget: expected a token count, got None")
    att = _attention(attention, important, check)
    if att.heads != 1:
        raise KvsimError(f"attention: expected one head for simulate(matrix, policy, budget, "
                         f"prompt_len), got {att.heads}; use policies=[...], budgets=[...]")
    P = _prompt_len(prompt_len, att.T)
    configs = _configs([policy], params)
    if isinstance(budget, (list, tuple)):
        raise KvsimError(f"budget: expected a token count or a prompt fraction, got {budget!r}"
                         f"; use budgets=[...] for several")
    caps = _capacities(configs, arguments.budgets([budget], P, "budget"), att.T, P, "budget")
    seed = arguments.seeds(None, seed)[0]
    run = _Run(att, P, configs, caps, [seed], (), 1, lambda s, kv: s)
    config, (budget, _) = configs[0], caps[configs[0].label][0]
    run.prepare()
    trace = run.traces(seed, 0, config)[0]
    truth = att.has_truth
    return SimulationResult(config.kind, budget, P, config.params, trace.mass[0],
                            trace.cache_size, trace.kept, trace.recall[0] if truth else None,
                            final_recall(trace.kept, run.truth(seed)[0]) if truth else None)


def _attention(attention, important, check) -> Attention:
    if isinstance(attention, Attention):
        if important is not None:
            raise KvsimError("important: expected it on the Attention constructor "
                             "(Attention.from_probs(..., important=...)), got it on simulate")
        return attention
    return Attention._probabilities(attention, None, important, "mean", check, own=False)


def _prompt_len(value, T: int) -> int:
    if value is None:
        raise KvsimError(f"prompt_len: expected an integer in [0, {T}], got None")
    return arguments.integer(value, "prompt_len", 0, T)


def _record(value) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)) or any(v not in RECORDABLE for v in value):
        raise KvsimError(f"record: expected a tuple of {', '.join(RECORDABLE)}, got {value!r}")
    return tuple(value)


def _configs(policies, params: dict) -> list[PolicyConfig]:
    """Checked policy configurations; ``params`` go to every policy that has them."""
    if isinstance(policies, dict):
        tables = policies
        if not tables:
            raise KvsimError("policies: expected a non-empty list of policy names, got {}")
    else:
        names = arguments.items(policies, "policies", "policy names")
        for i, name in enumerate(names):
            if not isinstance(name, str):
                raise KvsimError(f"policies[{i}]: expected a policy name, got {name!r}")
        tables = {name: {} for name in names}
        if len(tables) != len(names):
            raise KvsimError(f"policies: expected distinct names, got {names}; give several "
                             f"configurations as {{label: {{'kind': name, ...}}}}")
    used: set = set()
    configs = []
    for label, table in tables.items():
        if not isinstance(label, str) or not isinstance(table, dict):
            raise KvsimError(f"policies: expected {{label: {{'kind': name, param: value}}}}, "
                             f"got {label!r}: {table!r}")
        own = dict(table)
        kind = own.pop("kind", label)
        if not isinstance(kind, str):
            raise KvsimError(f"policies.{label}.kind: expected a policy name, got {kind!r}")
        spec = get_policy(kind)
        shared = {k: v for k, v in params.items()
                  if (k in spec.params or k in PROTOCOL_PARAMS) and k not in own}
        used.update(shared)
        configs.append(PolicyConfig(label, kind, resolve_params(spec, {**shared, **own})))
    unused = sorted(set(params) - used)
    if unused:
        raise KvsimError(f"{unused[0]}: expected a parameter of a selected policy "
                         f"({', '.join(c.label for c in configs)}), got one none of them has")
    return configs


def _capacities(configs: list[PolicyConfig], budgets: list[int], T: int, P: int,
                name: str = "budgets") -> dict[str, list[tuple[int, int]]]:
    """Per policy label, (budget, capacity run) pairs after the budget checks.

    A cache never holds more than ``T`` keys, so a budget above ``max(T, floor)`` gives the
    same run as that bound (nothing is ever evicted): it runs at the bound, and the
    results report the budget asked for.
    """
    out = {}
    for config in configs:
        spec = POLICIES[config.kind]
        for problem in run_problems(spec, config.params, budgets, T, P):  # the first one
            if problem.kind == "budget":
                where = name if name == "budget" else f"{name}[{problem.budget}]"
                raise KvsimError(f"{where}: {problem.message}")
            raise KvsimError(problem.message, f"{config.label}.{problem.key}")
        full = max(spec.saturation(T, config.params), spec.min_budget(config.params))
        out[config.label] = [(budget, min(budget, full)) for budget in budgets]
    return out


class _Run:
    """One call's work: groups per (seed, KV head), policies on a thread pool."""

    def __init__(self, att: Attention, P: int, configs, caps, seeds, record, workers, seed_of):
        self.att, self.P, self.configs, self.caps = att, P, configs, caps
        self.seeds, self.record, self.workers, self.seed_of = seeds, record, workers, seed_of
        self.steps = np.arange(att.T - P, dtype=np.int64)
        self.groups: dict = {}
        self.source = ("a dense attention matrix" if att.kind in ("probabilities", "logits")
                       else f"the {att.kind!r} attention")

    def truth(self, seed: int) -> np.ndarray:
        """(H, T) ground-truth mask (all False without ground truth)."""
        return self.att.field(seed).mask

    def group(self, seed: int, kv: int, capacity: int = -1):
        """KV head ``kv``'s group; runs at ``capacity`` record their cache at every step."""
        field = self.att.field(seed)
        return make_group(field.data, kv, self.P, self.truth(seed), self.att.passes(seed),
                          GQA_MODES[self.att.gqa], self.seed_of(seed, kv), capacity,
                          self.steps if capacity >= 0 else None)

    def traces(self, seed: int, kv: int, config: PolicyConfig) -> list:
        """The traces of one policy at every budget, on one KV head."""
        spec = POLICIES[config.kind]
        capacities = [cap for _, cap in self.caps[config.label]]
        if "kept" not in self.record:
            return run_budgets(spec, self.groups[seed, kv], capacities, config.params, self.source)
        # Recording: each budget's run records its cache (the full policy's is T wide).
        return [run_budgets(spec, self.group(seed, kv, cap if spec.budgeted else self.att.T),
                            [cap], config.params, self.source)[0] for cap in capacities]

    def prepare(self) -> None:
        """One group per (seed, KV head), shared by its policies (and their memoised row
        sums), built before the pool: a component field's full passes run here, on every
        core."""
        self.groups = {(s, kv): self.group(s, kv) for s in self.seeds
                       for kv in range(self.att.kv_heads)}

    def results(self) -> Results:
        tasks = [(s, kv, c) for s in self.seeds for kv in range(self.att.kv_heads)
                 for c in self.configs]
        self.prepare()
        threads = min(self.workers, len(tasks))
        if threads > 1:
            with ThreadPoolExecutor(threads) as pool:
                done = list(pool.map(lambda task: self.traces(*task), tasks))
        else:
            done = [self.traces(*task) for task in tasks]
        return self._collect(tasks, done)

    def _collect(self, tasks, done) -> Results:
        """The results: step series now, rows (their summaries) when first asked for."""
        att, P = self.att, self.P
        units: list[tuple] = []  # per row: (seed, head, kv head, config, budget, trace, g)
        series = ExperimentSteps()
        kept: dict = {}
        group = att.heads // att.kv_heads
        for (seed, kv, config), traces in zip(tasks, done):
            for (budget, _), trace in zip(self.caps[config.label], traces):
                if "kept" in self.record:
                    kept[config.label, budget, seed, kv] = trace.snapshots
                for g, h in enumerate(range(kv * group, (kv + 1) * group)):
                    units.append((seed, h, kv, config, budget, trace, g))
                    series.add(trace, g, att.has_truth)
        arrays = series.series(att.T - P)
        key = ("", "simulate")
        truths = {seed: self.truth(seed) for seed in self.seeds}
        return Results("simulate", functools.partial(_rows, units, att.T, P, att.has_truth,
                                                     truths),  # picklable, unlike a lambda
                       {key: arrays}, {key: (self.steps, kept)} if kept else {})


def _rows(units: list[tuple], T: int, P: int, has_truth: bool, truths: dict) -> list[dict]:
    """The results rows of a call's runs (``units`` as :meth:`_Run._collect` lists them;
    ``truths``: the (H, T) ground-truth mask of each seed)."""
    rows = []
    for seed, h, kv, config, budget, trace, g in units:
        ident = {"variant": "", "experiment": "simulate", "unit": len(rows),
                 "policy": config.label, "kind": config.kind, "budget": budget,
                 "budget_spec": budget, "seed": seed, "head": h, "kv_head": kv,
                 "T": T, "prompt_len": P, "steps": T - P}
        rows.append(result_row(ident, config.kind, config.params, trace, g, truths[seed][h],
                               has_truth, T))
    return rows
