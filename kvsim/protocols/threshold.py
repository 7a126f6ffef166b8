"""``threshold = tau``: append-only keep-or-drop by score, with no budget (DESIGN section 9).

The ``threshold_window`` newest keys are always held; a key leaving the window stays for
good iff its current score (``Steps.rank``) is ``>= tau``. The policy starts with the whole
prompt, so that every prompt key has its prefill score; the cache size is an outcome.
"""

from __future__ import annotations

import numpy as np

from kvsim.numerics.decode import Outputs
from kvsim.params import Param
from kvsim.policies.base import Group
from kvsim.protocols.base import Protocol, every_key, judges_scores
from kvsim.protocols.cache import Run


def _thresholded(run: Run, group: Group, out: Outputs, budget: int, proto: dict,
                 params: dict) -> None:
    """Append-only: the ``w`` newest keys held; a key leaving the window (key ``t - w`` as
    ``t`` joins; at the prefill every key before ``P - w``) stays for good iff its current
    score is ``>= tau``."""
    tau, w = proto["threshold"], proto["threshold_window"]
    P, T, seed = group.prompt_len, group.T, group.seed
    value, _ = run.scores(-1, seed)
    pos = run.cache[:run.n]
    run.remove(np.flatnonzero((pos < P - w) & ~(value >= tau)))
    for t in range(P, T):
        if t - w >= 0:
            value, _ = run.scores(t, seed)
            slot = np.flatnonzero(run.cache[:run.n] == t - w)
            if slot.size and not value[slot[0]] >= tau:
                run.remove(slot)
        run.span(group, out, t, t + 1)


def is_threshold(protocol: str) -> bool:
    """Whether a results ``protocol`` (:func:`kvsim.protocols.settings.label`) keeps keys by
    a threshold: its runs have no budget."""
    return any(part.startswith("threshold=") for part in protocol.split("+"))


PROTOCOL = Protocol(
    "threshold",
    params={
        "threshold": Param(float, None, "keep a key leaving the window for good iff its score "
                           ">= this (append-only; no budget)"),
        "threshold_window": Param(int, 128, "the newest keys always held under a threshold",
                                  low=1, high=2**31, expect="an integer >= 1"),
    },
    asked=lambda proto: "threshold" if proto["threshold"] is not None else None,
    label=lambda proto: f"threshold={proto['threshold']:g}/window={proto['threshold_window']}",
    check=lambda policy, proto, params, budget, P, T: judges_scores(policy, "threshold"),
    extra=lambda proto: None,
    drive=_thresholded,
    capacity=every_key,
    start_whole=True,
)
