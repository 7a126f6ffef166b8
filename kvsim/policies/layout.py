"""What a policy declares about its step state and its fixed parts, for the protocols.

The protocols (:mod:`kvsim.protocols`) compact, widen and protect a policy's cache from
outside its own step code; they read this declaration (``Policy.layout``) and nothing else
of the policy's state. ``tests/test_layouts.py`` checks every registered declaration
against the state that the policy's ``start`` builds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np


def _none(*args) -> int:
    return 0


@dataclass(frozen=True)
class StateLayout:
    """The layout of a policy's step state (the ``State`` its ``start`` returns).

    ``slots``: the fields holding one entry per cache slot, on their last axis (which grows
    with the budget; a scratch entry for the incoming key included), or a function of the
    policy's parameters giving them. ``slot_of``: the state has a ``slot_of`` field mapping
    positions to slots. ``ring``: the state has a ring ``base``, ``start``, ``width``
    (slots ``base ..`` refilled oldest first; the slots below ``base`` protected).
    ``position_rule``: the policy keeps keys by position alone (a ring with no score).
    ``pairs``: those of the per-slot fields that hold one entry per pair of slots, on their
    last two axes (a matrix over the slots). ``seeded_rank``: its ranking is a random draw
    seeded per KV head, so the scores of a layer's KV heads have no meaningful sum.

    Fixed parts: ``recent(budget, params)``, the newest tokens never evicted, held in the
    state's ``recent`` field (a policy that also gives ``Policy.run_capped`` takes
    ``recent=`` in its ``start``, the count of the mean budget under a cap);
    ``sinks(params)``, the first positions always kept.

    ``widen(state, budget, extra, seed)``, where the layout is special, finishes a state
    widened by ``extra`` slots (:func:`widen` has padded the slots and grown the ring).
    """

    slots: frozenset[str] | Callable[[dict], frozenset[str]] = frozenset()
    slot_of: bool = False
    ring: bool = False
    position_rule: bool = False
    pairs: frozenset[str] = frozenset()
    seeded_rank: bool = False
    recent: Callable[[int, dict], int] | None = None
    sinks: Callable[[dict], int] = _none
    widen: Callable[[NamedTuple, int, int, int], NamedTuple] | None = None

    def slot_fields(self, params: dict) -> frozenset[str]:
        """The per-slot fields of the state under ``params``."""
        return self.slots(params) if callable(self.slots) else self.slots

    def recent_count(self, budget: int, params: dict) -> int:
        """The newest tokens protected at ``budget`` (0 without a recent part)."""
        return 0 if self.recent is None else self.recent(budget, params)


RING = StateLayout(ring=True, position_rule=True)
"""The layout of the ring alone (``window``, ``streaming_llm``)."""


def widen(state: NamedTuple, layout: StateLayout, params: dict, budget: int, extra: int,
          seed: int) -> NamedTuple:
    """A copy of a policy's step state at ``budget`` with ``extra`` more cache slots,
    everything else as it was (the fixed parts stay those of the budget): the keys of the
    question of ``before_question`` then join without eviction (a step appends while the
    cache has room), and later steps evict from the ``budget + extra`` slots.

    The per-slot fields are padded with zeros along their last axis (a new slot holds no
    score, no vote, no pin), the pair fields along the one before too; a ring widens by ``extra``, so that its oldest key still leaves
    first; then the layout's own ``widen`` hook, if any.
    """
    if extra <= 0:
        return state
    fields = state._asdict()
    for name in layout.slot_fields(params):
        value = fields[name]
        fields[name] = np.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, extra)])
    for name in layout.pairs:
        value = fields[name]
        fields[name] = np.pad(value, [(0, 0)] * (value.ndim - 2) + [(0, extra), (0, 0)])
    if layout.ring:
        fields["width"] = int(fields["width"]) + extra
    state = type(state)(**fields)
    return state if layout.widen is None else layout.widen(state, budget, extra, seed)
