"""Run one policy at one budget on one attention head, with its invariants checked."""

from __future__ import annotations

import dataclasses
import difflib
from typing import NamedTuple, Sequence

import numpy as np

from kvsim.errors import InvariantError, KvsimError
from kvsim.numerics.field import FieldData
from kvsim.numerics.kernels import GQA_MEAN
from kvsim.policies import POLICIES, Group, Policy, Trace
from kvsim.protocols import settings
from kvsim.protocols.dispatch import run_protocol

MASS_TOL = 1e-9


def did_you_mean(name: str, options) -> str:
    """`` (did you mean 'x'?)`` for the closest option, or an empty string."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def get_policy(name: str) -> Policy:
    """The registered policy called ``name``; a clear error otherwise."""
    if name not in POLICIES:
        raise KvsimError(f"expected one of {', '.join(POLICIES)}, got unknown policy "
                         f"{name!r}{did_you_mean(name, POLICIES)}", "policy")
    return POLICIES[name]


def resolve_params(policy: Policy, params: dict) -> dict:
    """Defaults filled in and every value checked; raises :class:`KvsimError`."""
    resolved = {}
    spec = {**policy.params, **settings.PROTOCOL_PARAMS}  # protocol settings fit any policy
    for key, value in params.items():
        if key not in spec:
            known = ", ".join(policy.params) or "none"
            raise KvsimError(f"unknown parameter {key!r}{did_you_mean(key, spec)}; "
                             f"its parameters: {known} (and the protocol settings "
                             f"{', '.join(settings.PROTOCOL_PARAMS)})", policy.name)
        problem = spec[key].problem(value)
        if problem:
            raise KvsimError(problem, f"{policy.name}.{key}")
        resolved[key] = float(value) if spec[key].type is float else value
    # protocol settings only where given: a policy's columns stay as they were without them
    return {**{k: resolved.get(k, p.default) for k, p in policy.params.items()},
            **{k: v for k, v in resolved.items() if k in settings.PROTOCOL_PARAMS}}


def budget_problem(policy: Policy, budget: int, params: dict) -> str | None:
    """Why ``budget`` is too small for ``policy`` with ``params``, or None."""
    floor = policy.min_budget(params)
    if budget >= floor:
        return None
    fixed = "" if floor == 1 else f" ({policy.floor_reason})"
    return f"expected at least {floor} for {policy.name}{fixed}, got {budget}"


class RunProblem(NamedTuple):
    """One problem of a run, found by :func:`run_problems`.

    ``kind``: whose check found it: ``"stepping"`` (why the policy cannot step one token at
    a time), ``"budget"`` (the policy's floor), ``"protocol"`` (the protocol settings at
    that budget) or ``"policy"`` (its own cross-parameter check, ``Policy.check``);
    ``key``: the parameter or setting at fault ("" for the policy as a whole); ``budget``:
    the index of the budget concerned, or None.
    """

    kind: str
    key: str
    message: str
    budget: int | None = None


def run_problems(policy: Policy, params: dict, budgets: Sequence[int] = (),
                 T: int | None = None, prompt_len: int | None = None,
                 stepping: bool = False, widens: bool = False) -> list[RunProblem]:
    """Every problem of running ``policy`` with its resolved ``params`` at each of
    ``budgets`` on ``T`` tokens, the first ``prompt_len`` the prompt (None: sizes not known
    yet, the checks that need them left out): the one run check of the scenario loader, the
    Python API, the :class:`~kvsim.protocols.stepping.Stepper` and the study files.

    In order: for a policy stepped one token at a time inside a model (``stepping``), a
    protocol it cannot take (a study steps the per-step rule) and why it cannot step (with
    ``widens``, a task protocol that widens the stepped cache for its question: a layout to
    widen by); per budget, its floor, then (the floor met, sizes known, not stepping) the
    protocol; the policy's own check. What this accepts runs.
    """
    out = []
    # the protocols a model steps run a layer at a time (stepping.UniformLayer)
    layered = stepping and settings.steps_in_model(params)
    if stepping:
        if not settings.is_neutral(settings.split(params)[1]) and not layered:
            out.append(RunProblem("stepping", settings.asked(params)[0], (
                f"expected the per-step rule or a protocol a model steps "
                f"({', '.join(settings.in_model())}; a policy stepped one token at a time "
                f"takes no other), got {settings.label(params)}: the others are the "
                f"simulator's")))
        blocks = policy.layer_cache is not None  # stepped a layer at a time (BlockLayer)
        reason = policy.closed_loop(params) or (
            "it has no step code" if policy.steps is None and not blocks else None) or (
            "it declares no state layout (Policy.layout) to widen its cache by for the "
            "question" if widens and policy.layout is None and not blocks else None)
        if reason:
            out.append(RunProblem("stepping", "", reason))
    sized = T is not None and prompt_len is not None
    for i, budget in enumerate(budgets):
        problem = budget_problem(policy, budget, params)
        if problem:
            out.append(RunProblem("budget", "", problem, i))
        elif sized and (layered or not stepping):
            found = settings.problem(policy, params, budget, prompt_len, T)
            if found:
                out.append(RunProblem("protocol", *found, i))
    found = policy.check(T, prompt_len, params) if sized else None
    if found:
        out.append(RunProblem("policy", found.key, found.message))
    return out


def check_invariants(policy: Policy, budget: int, group: Group, trace: Trace,
                     params: dict | None = None) -> None:
    """Raise :class:`InvariantError` if the trace breaks a contract invariant (the peak
    is the budget's, or that of the protocol of ``params``)."""
    name = policy.name
    limit = settings.peak_limit(budget, params or {}, group.T) if policy.budgeted else group.T
    if (trace.cache_size > limit).any() or trace.kept.shape[0] > limit:
        raise InvariantError(f"{name}: cache exceeded its limit of {limit} keys")
    if ((trace.mass < -MASS_TOL) | (trace.mass > 1 + MASS_TOL)).any():
        raise InvariantError(f"{name}: mass outside [0, 1]")
    if name == "full" and (np.abs(trace.mass - 1.0) > MASS_TOL).any():
        raise InvariantError("full: mass differs from 1")


NEED_WORDS = {"keys": "key vectors", "values": "value vectors", "queries": "query vectors",
              "rope": "pre-RoPE query vectors with RoPE settings"}


def missing_needs(policy: Policy, provides: frozenset) -> str | None:
    """What ``policy`` needs that a source providing ``provides`` lacks (words), or None."""
    return " and ".join(NEED_WORDS[n] for n in sorted(policy.needs - provides)) or None


def field_provides(field: FieldData, kv_head: int) -> frozenset:
    """What a field has besides attention for KV head ``kv_head`` (see ``Policy.needs``)."""
    return frozenset(name for name, present in (
        ("keys", field.keys.shape[1] > 0), ("queries", field.queries.shape[2] > 0),
        ("values", field.has_values(kv_head)),
        ("rope", field.pre_rope_queries.shape[2] > 0 and field.rope_freq.shape[0] > 0))
        if present)


def check_source(policy: Policy, group: Group, source: str) -> None:
    """A one-line :class:`KvsimError` if ``policy`` needs what ``source`` (its description,
    e.g. "a dense attention matrix") does not have for ``group``."""
    missing = missing_needs(policy, field_provides(group.field, group.kv_head))
    if missing:
        raise KvsimError(f"{policy.name}: needs {missing}, which {source} does not have")


def run_policy(policy: Policy, group: Group, budget: int, params: dict,
               source: str = "this attention source") -> Trace:
    """Run a checked policy on one KV head's ``group`` and assert the invariants."""
    return run_budgets(policy, group, [budget], params, source)[0]


def run_budgets(policy: Policy, group: Group, budgets: list[int], params: dict,
                source: str = "this attention source") -> list[Trace]:
    """:func:`run_policy` at several budgets, sharing work where the policy can; ``source``
    describes the attention source in the error if the policy needs what it lacks. A budget
    below the policy's minimum is a one-line :class:`KvsimError` (its kernel would write
    out of bounds)."""
    for problem in run_problems(policy, params, budgets):
        raise KvsimError(problem.message, "budget")
    check_source(policy, group, source)
    if settings.is_neutral(settings.split(params)[1]):
        traces = policy.run_all(group, [int(b) for b in budgets], params)
    else:
        traces = [run_protocol(policy, group, int(b), params) for b in budgets]
    for budget, trace in zip(budgets, traces):
        check_invariants(policy, budget, group, trace, params)
    return traces


def run_capped(policy: Policy, group: Group, cap: int, budget: int, params: dict,
               focus: bool = False, source: str = "this attention source") -> Trace:
    """Run ``policy`` on one KV head with at most ``cap`` keys and the fixed parts of
    ``budget`` (a cap from budget allocation), its invariants checked against the cap; the
    run records cache snapshots if ``focus`` and the group records them at all."""
    check_source(policy, group, source)
    snap = cap if focus and group.snap_budget >= 0 else -1
    group = dataclasses.replace(group, snap_budget=snap)  # shares the group's memos
    if settings.is_neutral(settings.split(params)[1]):
        trace = policy.run_cap(group, cap, budget, params)
    else:
        trace = run_protocol(policy, group, budget, params, cap)
    check_invariants(policy, cap, group, trace, params)
    return trace


def make_group(field: FieldData, kv_head: int, prompt_len: int, important: np.ndarray,
               passes: dict, gqa: int = GQA_MEAN, seed: int = 0, snap_budget: int = -1,
               snap_steps: np.ndarray | None = None, progress: bool = False) -> Group:
    """The :class:`Group` of KV head ``kv_head``; full passes are memoised in ``passes``.

    ``important`` is an (H, T) mask; ``passes`` is the memo of full passes shared by the
    groups of one sequence; runs at ``snap_budget`` record their cache at the decode
    steps ``snap_steps``. A component field's passes run here, on the calling thread
    (``progress``: long ones show their rows on stderr).
    """
    heads = np.arange(kv_head * field.group, (kv_head + 1) * field.group, dtype=np.int64)
    group = Group(field, heads, prompt_len, passes, np.ascontiguousarray(important[heads]), gqa,
                  seed, snap_budget, np.zeros(0, np.int64) if snap_steps is None else snap_steps,
                  progress=progress)
    if not field.is_dense:
        group.row_max  # noqa: B018 - every policy needs the row statistics: compute them now
    return group


def final_recall(kept: np.ndarray, important: np.ndarray) -> float:
    """Share of the important positions (mask) found in ``kept``; NaN if there are none."""
    total = int(important.sum())
    return float(important[kept].sum()) / total if total else float("nan")
