"""The Python API for one attention matrix: :func:`simulate` and its result."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.attention.dense import probabilities
from kvsim.numerics.field import dense_field
from kvsim.policies.run import (check_run, final_recall, get_policy, important_mask, make_group,
                                resolve_params, run_policy)


@dataclass(frozen=True)
class SimulationResult:
    """Outcome of :func:`simulate`.

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


def simulate(attention: np.ndarray, policy: str, budget: int, prompt_len: int, *,
             important=None, seed: int = 0, **params) -> SimulationResult:
    """Simulate one eviction policy on one causal attention matrix.

    Parameters
    ----------
    attention : (T, T) array of row-normalised causal attention probabilities.
    policy : a registered policy name (see ``kvsim.POLICIES``).
    budget : cache budget in tokens (ignored by ``full``).
    prompt_len : prompt length ``P``; steps ``P .. T-1`` are decoded one by one.
    important : optional ground-truth important positions, for recall.
    seed : seed of the ``random`` policy.
    **params : the policy's parameters (e.g. ``sinks=4``, ``recent_ratio=0.5``).

    Raises
    ------
    KvsimError
        For any invalid argument.
    """
    spec = get_policy(policy)
    resolved = resolve_params(spec, params)
    attn = probabilities(attention)
    T = attn.shape[0]
    check_run(spec, budget, T, prompt_len, resolved)
    mask = important_mask(important, T)
    group = make_group(dense_field(attn[None]), 0, int(prompt_len), mask[None], {},
                       seed=int(seed))
    trace = run_policy(spec, group, int(budget), resolved, "a dense attention matrix")
    has_truth = important is not None
    return SimulationResult(
        policy, int(budget), int(prompt_len), resolved, trace.mass[0], trace.cache_size,
        trace.kept, trace.recall[0] if has_truth else None,
        final_recall(trace.kept, mask) if has_truth else None)
