"""Budget allocation across KV heads and layers: ``uniform``, ``ada``, ``pyramid``, ``cake``.

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
- ``cake`` (CAKE, Qin et al. 2025; antgroup/cakekv ``c4675ce``): each layer's preference
  ``P_l = H_l^(1/tau1) * V_l^(1/tau2)`` from the attention of its last 32 prompt queries
  to the prefix keys (entropy ``H_l``, summed unbiased variances ``V_l``, over every query
  head); the selectable slots ``L * (B - fixed)`` go to the layers in proportion (floored),
  through the authors' ``adjust_budgets``, each at most ``P - fixed`` and at least 1 (a
  share of 0 takes a slot from the largest share); every KV head of layer ``l`` gets
  ``fixed + b_l``.

A head's fixed parts (sinks, observation window, recent tokens) stay those of ``B``
whatever its cap; only its selectable part grows or shrinks.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from kvsim.errors import InvariantError
from kvsim.numerics.field import logits_row
from kvsim.protocols.run import get_policy
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


CAKE_WINDOW = 32  # the prompt queries whose attention rates a layer (the code's window_size)


def cake_preference(rows: list[np.ndarray], n: int, tau1: float, tau2: float) -> float:
    """A layer's preference from ``rows[h]`` (w, >= n), the full attention of its last
    ``w`` prompt queries in query head ``h``, over the prefix keys ``0 .. n-1``:
    ``H^(1/tau1) * V^(1/tau2)``, ``H = -sum A log(A + 1e-10)``, ``V`` = the unbiased
    variances over the queries, summed over keys and heads."""
    entropy = variance = 0.0
    for a in rows:
        a = a[:, :n]
        entropy -= float(np.sum(a * np.log(a + 1e-10)))
        variance += float(np.sum(np.var(a, axis=0, ddof=1)))
    return entropy ** (1.0 / tau1) * variance ** (1.0 / tau2)


def adjust_budgets(budgets: list[float], total: int, seq_len: int) -> np.ndarray:
    """The authors' ``adjust_budgets``: truncate to integers, cap at ``seq_len`` and hand
    the excess out evenly (remainder to the first) to the layers below it, then make the
    sum ``total`` by adding to layers below ``seq_len`` or taking from layers above 1."""
    b = np.array(budgets, dtype=np.int64)  # truncation, as numpy's int cast
    excess = int(np.maximum(b - seq_len, 0).sum())
    b = np.minimum(b, seq_len)
    if excess > 0:
        valid = b < seq_len
        if valid.sum() > 0:
            b[valid] += excess // int(valid.sum())
            b[np.flatnonzero(valid)[:excess % int(valid.sum())]] += 1
    diff = total - int(b.sum())
    if diff != 0:
        valid = b < seq_len if diff > 0 else b > 1
        count = int(valid.sum())
        if count > 0:
            step = 1 if diff > 0 else -1
            b[valid] += step * (abs(diff) // count)
            b[np.flatnonzero(valid)[:abs(diff) % count]] += step
    return b


def cake_caps(preferences: np.ndarray, budget: int, fixed: int, prompt_len: int) -> np.ndarray:
    """Per-layer caps under CAKE: ``fixed + b_l``, ``b_l`` = ``adjust_budgets`` of
    ``floor(P_l / sum P * L * (B - fixed))``, then at most ``P - fixed`` and at least 1
    (:func:`floor_shares`). Every layer keeps
    ``B`` when the prompt fits (``P <= B``) or no layer has a preference."""
    layers = preferences.shape[0]
    total = layers * (budget - fixed)
    if prompt_len <= budget or not preferences.sum() > 0:
        return np.full(layers, budget, np.int64)
    shares = [p / preferences.sum() * total for p in preferences]
    b = np.minimum(adjust_budgets(shares, total, prompt_len - fixed), prompt_len - fixed)
    return (fixed + floor_shares(b, total)).astype(np.int64)


def floor_shares(shares: np.ndarray, total: int) -> np.ndarray:
    """Every layer keeps at least one selectable slot: a share of 0 becomes 1, and while
    the shares exceed ``total`` the largest (the earliest among equals) gives one back
    (``total`` is at least the number of layers: every budget leaves a slot)."""
    shares = np.maximum(shares, 1)
    for _ in range(int(shares.sum()) - total):
        shares[np.argmax(shares)] -= 1
    return shares


def layer_window_rows(field, P: int, w: int) -> list[np.ndarray]:
    """(w, P) full causal attention of queries ``P-w .. P-1`` of every query head of a
    field (float64 softmax of its logits; a dense field's own rows)."""
    out = []
    keys = np.arange(P)
    for h in range(field.heads):
        if field.is_dense:
            out.append(np.array(field.probs[h, P - w:P, :P], np.float64))
            continue
        rows = np.zeros((w, P))
        work = np.empty(P)
        for i, q in enumerate(range(P - w, P)):
            logits = np.empty(q + 1)
            logits_row(field, h, q, keys, q + 1, logits, work)
            e = np.exp(logits - logits.max())
            rows[i, :q + 1] = e / e.sum()
        out.append(rows)
    return out


def cake_preferences(fields: Iterable, P: int, tau1: float, tau2: float) -> np.ndarray:
    """Each layer's preference (``fields``: one per layer run jointly, in order, read one
    at a time); 0 when the window covers the prompt."""
    w = min(CAKE_WINDOW, P)
    return np.array([cake_preference(layer_window_rows(f, P, w), P - w, tau1, tau2)
                     if P - w > 0 and w >= 2 else 0.0 for f in fields])


def check_total(caps: np.ndarray, total: int, where: str) -> None:
    """Raise :class:`InvariantError` unless the caps sum to ``total``."""
    if int(np.sum(caps)) != total:
        raise InvariantError(f"{where}: per-head caps sum to {int(np.sum(caps))}, "
                             f"expected the layer total {total}")


def layer_caps(scenario: Scenario, exp: Experiment, group_for, place: int,
               preferences: np.ndarray | None = None) -> np.ndarray:
    """Caps ``b_h`` of one layer, shape (policies, budgets, KV heads).

    ``place`` is the layer's index among the layers run jointly; ``group_for(exp, kv)``
    gives KV head ``kv``'s group (needed by ``ada`` only); ``preferences`` the layers'
    CAKE preferences (``cake`` only). Unbudgeted policies (``full``)
    and ``uniform`` get ``B``. Raises :class:`InvariantError` if the caps of a layer do
    not add up or a cap leaves no selectable slot beside the fixed parts.
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
            elif exp.allocation == "cake":
                per_layer = cake_caps(preferences, budget, fixed, exp.prompt_len)
                if per_layer.sum() > layers * budget:  # the cap at P - fixed may leave keys
                    check_total(per_layer, layers * budget, where)
                caps[i, j] = per_layer[place]
            else:
                groups = groups or [group_for(exp, kv) for kv in range(kv_heads)]
                scores = [policy.prefill_score(g, budget, config.params) for g in groups]
                caps[i, j] = ada_caps(scores, budget, fixed, exp.floor_share)
            check_total(caps[i, j], kv_heads * int(caps[i, j, 0] if exp.allocation in
                                                   ("pyramid", "cake") else budget), where)
            if caps[i, j].min() <= fixed:  # the kernels need a selectable slot
                raise InvariantError(f"{where}: a cap of {caps[i, j].min()} leaves no "
                                     f"selectable slot beside the fixed parts ({fixed})")
    return caps
