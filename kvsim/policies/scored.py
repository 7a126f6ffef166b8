"""Score-only rules: a rule gives each position a score; this module does the rest.

A score-only rule is one function, ``score(group, lo, hi, params) -> (hi - lo,) float64``:
the scores of positions ``lo .. hi-1`` (higher is kept), read from the :class:`Group`
(``group.keys`` (d, T) by dimension, ``group.values`` (T, dv), ``group.global_scores()``,
...). A position's score never changes once given, and must not depend on ``lo`` and
``hi`` (the closed loop asks for one position at a time as tokens arrive, the simulator
for all at once); a rule that reads a position's vectors reads rows ``< hi`` only.

:func:`score_policy` turns it into a :class:`Policy`: keep the ``recent`` newest tokens
(``int(recent_ratio * budget)``, the incoming one included) and the highest scores among
the others; when full, the incoming token joins and the lowest score outside the recent
ones goes (ties: :func:`kvsim.numerics.kernels.lowest_ranked_slot`). Every such rule
shares one compiled decode loop, budget allocation (the recent tokens are the fixed
part, the older prompt keys selectable by score) and the step-by-step driver.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import numpy as np

from kvsim.numerics import kernels
from kvsim.numerics.decode import decode_kernel, observe_nothing
from kvsim.numerics.jit import jit_inline
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps, Trace, current, run_decode
from kvsim.policies.layout import StateLayout

Score = Callable[[Group, int, int, dict], np.ndarray]


def recent_ratio(default: float) -> Param:
    """The ``recent_ratio`` parameter with its default."""
    return Param(float, default, "share of the budget kept for the newest tokens",
                 check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)")


def recent_count(budget: int, params: dict) -> int:
    """Number of newest tokens protected from eviction."""
    return int(params["recent_ratio"] * budget)


def prefill(P: int, budget: int, recent: int, ranking: np.ndarray) -> np.ndarray:
    """The prefill selection: every prompt key if they fit, else the ``recent`` newest and
    the ``budget - recent`` best-ranked older ones (positions ``0 .. P - recent - 1``)."""
    if P <= budget:
        return np.arange(P)
    heavy = kernels.top_ranked(ranking, 0, P - recent, budget - recent)
    return np.concatenate((heavy, np.arange(P - recent, P)))


SLOTS = frozenset({"score"})
"""The per-slot fields of :class:`State` (:class:`~kvsim.policies.layout.StateLayout`)."""


class State(NamedTuple):
    static: np.ndarray   # (T,) float64: the score of each position
    score: np.ndarray    # (B,) float64: the score of each slot's key
    slot_of: np.ndarray  # (T,) int64: the slot of each cached position
    recent: int          # the newest tokens (the incoming one included) never evicted


@jit_inline
def admit(state, cache, n, t):
    """Evict the lowest score outside the ``recent`` newest when full; t brings its own."""
    slot = n
    if n == cache.shape[0]:
        slot = kernels.lowest_ranked_slot(cache, n, state.score, t - state.recent + 1,
                                          state.slot_of)
    state.slot_of[t] = slot
    state.score[slot] = state.static[t]
    return slot


decode = decode_kernel("decode", admit, observe_nothing)


def start(score: Score, prompt: Group, budget: int, params: dict, T: int,
          recent: int | None = None) -> tuple[np.ndarray, State]:
    """Prefill and state; ``recent`` overrides the recent count (budget allocation keeps
    that of the mean budget whatever the head's cap). The simulator's group knows every
    position; a closed loop's knows its prompt (later ones come through :func:`prepare`)."""
    recent = recent_count(budget, params) if recent is None else recent
    P = prompt.prompt_len
    known = T if prompt.T >= T else P
    static = np.zeros(T)
    static[:known] = prompt.shared((score, known, *sorted(params.items())),  # any budget's
                                   lambda: score(prompt, 0, known, params))
    kept = prefill(P, budget, recent, static[:P])
    state = State(static, np.zeros(budget), np.zeros(T, np.int64), recent)
    state.score[:len(kept)], state.slot_of[kept] = static[kept], np.arange(len(kept))
    return kept, state


def rank(state: State, cache: np.ndarray, n: int, t: int, seed: int):
    """The static score of each cached key; the recent newest protected."""
    return current(state.score, cache, n, t, state.recent)


def prepare(score: Score, state: State, group: Group, params: dict, t: int) -> None:
    """Score token ``t`` before it joins (one step at a time: its vectors just arrived)."""
    state.static[t] = score(group, t, t + 1, params)[0]


def _run_capped(score: Score, group: Group, cap: int, budget: int, params: dict) -> Trace:
    kept, state = start(score, group, cap, params, group.T, recent_count(budget, params))
    return run_decode(group, cap, kept, decode, state)


def selectable(group: Group, budget: int, params: dict) -> int:
    """Prompt keys older than the recent ones (none when those cover the prompt)."""
    return max(group.prompt_len - recent_count(budget, params), 0)


def _prefill_score(score: Score, group: Group, budget: int, params: dict) -> np.ndarray:
    return score(group, 0, group.prompt_len, params)[:selectable(group, budget, params)]


def score_policy(name: str, summary: str, score: Score, *, recent: float = 0.0,
                 params: dict[str, Param] | None = None, needs: frozenset[str] = frozenset(),
                 closed_loop: Callable[[dict], str | None] = lambda params: None,
                 presentation: Presentation = Presentation()) -> Policy:
    """The :class:`Policy` of a score-only rule: ``recent`` is the default ``recent_ratio``,
    ``params`` its own parameters (passed to ``score``), ``needs`` what it reads besides
    attention (``"keys"``, ``"values"``), ``closed_loop`` why it cannot run one step at a
    time (e.g. a clairvoyant score), if so; ``presentation`` its family, table row, colour
    and marker."""
    return Policy(name, summary, {"recent_ratio": recent_ratio(recent), **(params or {})},
                  Steps(functools.partial(start, score), admit, observe_nothing, decode,
                        functools.partial(prepare, score), rank),
                  needs=frozenset(needs), closed_loop=closed_loop, presentation=presentation,
                  fixed=lambda budget, prompt_len, params: recent_count(budget, params),
                  prefill_score=functools.partial(_prefill_score, score),
                  run_capped=functools.partial(_run_capped, score),
                  layout=StateLayout(SLOTS, slot_of=True, recent=recent_count))
