"""Budget allocation across KV heads and layers: ``uniform``, ``ada`` and ``pyramid``.

The budget ``B`` of an experiment is the *mean* cap per KV head; an allocation turns it
into each KV head's own cap ``b_h`` (its hard limit for the whole decode), so that
allocations compare at equal memory. Plain NumPy: the rules run once per layer.

- ``uniform``: every KV head of every layer holds at most ``B``.
- ``ada`` (AdaKV, Feng et al. 2024): within a layer the selectable slots of every KV head
  (``B`` minus the policy's fixed parts) are pooled. Each head first takes its own top
  ``floor(floor_share * (B - fixed))`` selectable prompt keys, then the rest of the pool
  goes to the highest remaining prefill scores across the layer's heads (ties: lower head,
  then lower position). ``b_h`` = fixed + the head's share.
- ``pyramid`` (PyramidKV, Cai et al. 2024): layer ``l`` of ``L`` run jointly gets
  ``floor(b_max - (b_max - b_min) * l / (L - 1))``, from ``b_max = 2B - b_min`` down to
  ``b_min = fixed + ceil((B - fixed) / beta)``; the tokens that keep the mean at ``B``
  go one each to the earliest layers. No layer gets more than ``T`` (a head never holds
  more than the T keys of the sequence): a layer above it is cut to ``T`` and the tokens
  cut go one each, round after round, to the earliest layers still below ``T``, so the
  layers share ``L * B`` keys (budgets are at most ``T``, so they always fit).

A head's fixed parts (sinks, observation window, recent tokens) stay those of ``B``
whatever its cap; only its selectable part grows or shrinks.
"""

from __future__ import annotations

import math

import numpy as np

from kvsim.errors import InvariantError
from kvsim.policies.run import get_policy
from kvsim.scenario.load import Experiment, Scenario


def ada_caps(scores: list[np.ndarray], budget: int, fixed: int, floor_share: float) -> np.ndarray:
    """Caps ``b_h`` of one layer's KV heads under AdaKV.

    ``scores[h]`` holds KV head ``h``'s prefill scores of its selectable prompt keys
    (positions ``0 .. n-1``, the same ``n`` for every head; ``n = 0`` when the fixed parts
    cover the prompt, and then every head keeps ``budget``).
    """
    heads = len(scores)
    slots = budget - fixed
    n = scores[0].shape[0]
    if n <= slots:  # every candidate fits in every head: nothing to share
        return np.full(heads, budget, np.int64)
    own = math.floor(floor_share * slots)
    score, head, pos = [], [], []
    for h, s in enumerate(scores):
        order = np.lexsort((np.arange(n), -s))  # the head's own ranking: score, then position
        rest = order[own:]
        score.append(s[rest])
        head.append(np.full(rest.size, h))
        pos.append(rest)
    score, head, pos = np.concatenate(score), np.concatenate(head), np.concatenate(pos)
    pooled = heads * (slots - own)
    winners = np.lexsort((pos, head, -score))[:pooled]
    share = own + np.bincount(head[winners], minlength=heads)
    return (fixed + share).astype(np.int64)


def pyramid_budgets(budget: int, fixed: int, beta: float, layers: int, T: int) -> np.ndarray:
    """Per-layer caps under PyramidKV for ``layers >= 2`` layers run jointly, each at most
    ``T`` (``budget <= T``)."""
    b_min = fixed + math.ceil((budget - fixed) / beta)
    b_max = 2 * budget - b_min
    drop = b_max - b_min
    # floor(b_max - drop * l / (L - 1)) in integers: exact, whatever the sizes.
    caps = np.array([b_max - (-(-drop * layer // (layers - 1))) for layer in range(layers)],
                    np.int64)
    caps[:layers * budget - int(caps.sum())] += 1
    cut = int(np.maximum(caps - T, 0).sum())
    caps = np.minimum(caps, T)
    while cut:  # the keys above T, one each to the earliest layers with room, by rounds
        room = np.flatnonzero(caps < T)[:cut]
        caps[room] += 1
        cut -= room.size
    return caps


def check_total(caps: np.ndarray, total: int, where: str) -> None:
    """Raise :class:`InvariantError` unless the caps sum to ``total``."""
    if int(np.sum(caps)) != total:
        raise InvariantError(f"{where}: per-head caps sum to {int(np.sum(caps))}, "
                             f"expected the layer total {total}")


def layer_caps(scenario: Scenario, exp: Experiment, group_for, place: int) -> np.ndarray:
    """Caps ``b_h`` of one layer, shape (policies, budgets, KV heads).

    ``place`` is the layer's index among the layers run jointly; ``group_for(exp, kv)``
    gives KV head ``kv``'s group (needed by ``ada`` only). Unbudgeted policies (``full``)
    and ``uniform`` get ``B``. Raises :class:`InvariantError` if the caps of a layer do
    not add up.
    """
    kv_heads, layers = scenario.kv_heads, len(scenario.layers)
    caps = np.empty((len(exp.policies), len(exp.budgets), kv_heads), np.int64)
    groups = None
    for i, config in enumerate(exp.policies):
        policy = get_policy(config.kind)
        for j, budget in enumerate(exp.budgets):
            fixed = policy.fixed(budget, exp.prompt_len, config.params)
            where = f"{exp.name}: {config.label} at B = {budget}"
            if exp.allocation == "uniform" or not policy.budgeted:
                caps[i, j] = budget
            elif exp.allocation == "pyramid":
                per_layer = pyramid_budgets(budget, fixed, exp.beta, layers, scenario.T)
                check_total(per_layer, layers * budget, where)
                caps[i, j] = per_layer[place]
            else:
                groups = groups or [group_for(exp, kv) for kv in range(kv_heads)]
                scores = [policy.prefill_score(g, budget, config.params) for g in groups]
                caps[i, j] = ada_caps(scores, budget, fixed, exp.floor_share)
            check_total(caps[i, j], kv_heads * int(caps[i, j, 0] if exp.allocation == "pyramid"
                                                   else budget), where)
    return caps
