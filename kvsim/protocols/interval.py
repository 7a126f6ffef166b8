"""``interval`` and ``target_ratio``: batched compression (DESIGN section 9).

``interval = N``: the cache grows to ``B + N - 1`` keys, then is compressed to ``B - 1``
before the next key joins (peak ``B + N - 1``). With ``target_ratio = r``: every ``N``
steps the cache is compressed to ``K - 1`` keys, ``K = max(1, floor(r (t + 1)))`` (the
cache size is an outcome). Between two compressions the policy's own compiled loop runs
(its ``admit`` only appends); a compression ranks the cached keys once
(:meth:`kvsim.protocols.cache.Run.compress`).
"""

from __future__ import annotations

from kvsim.numerics.decode import Outputs
from kvsim.params import Param
from kvsim.policies.base import Group, Policy
from kvsim.protocols.base import Protocol
from kvsim.protocols.cache import Run


def _batched(run: Run, group: Group, out: Outputs, B: int, proto: dict, params: dict) -> None:
    """``interval = N``: down to ``B - 1`` keys when ``t`` would exceed ``B + N - 1``; with
    a ``ratio``, down to ``K - 1`` keys every ``N`` steps, ``K = max(1, floor(r (t + 1)))``.
    A policy that re-scores reads the decode queries since the last compression (or P)."""
    N, ratio = proto["interval"], proto["target_ratio"]
    P, T, capacity = group.prompt_len, group.T, run.cache.shape[0]
    t = since = P
    at = P + N - 1 if ratio != 1.0 else P + capacity - run.n  # the next compression step
    while t < T:
        if at > t:  # the policy's own loop up to it (t joins there after a compression)
            run.span(group, out, t, min(at, T))
            t = min(at, T)
            continue
        run.compress(max(1, int(ratio * (t + 1))) - 1 if ratio != 1.0 else B - 1, t, group.seed,
                     since, group, params)
        since = t
        at = t + N if ratio != 1.0 else t + capacity - run.n


def _capacity(first: int, kept: int, free: int, P: int, T: int, budget: int, proto: dict) -> int:
    if proto["target_ratio"] != 1.0:
        return max(budget, kept + free + T - P)  # never full: compressions make room
    return budget + proto["interval"] - 1


def _check(policy: Policy, proto: dict, params: dict, budget: int, P: int, T: int) -> str | None:
    """A target ratio must stay above the keys the policy protects at the first compression."""
    if proto["target_ratio"] == 1.0:
        return None
    first = P + proto["interval"] - 1  # the first compression step
    if first >= T:
        return None
    layout = policy.layout
    target = max(1, int(proto["target_ratio"] * (first + 1)))
    fixed = max(policy.fixed(budget, P, params), layout.sinks(params),
                layout.recent_count(budget, params))
    if policy.steps.rank is None and not layout.position_rule:
        fixed = budget - 1  # keys pinned at the prefill may all be protected
    if fixed >= target:
        return (f"expected a target above {policy.name}'s protected keys (up to {fixed} at "
                f"B = {budget}), got {target} keys at the first compression (t = {first})")
    return None


def _label(proto: dict) -> str:
    if proto["target_ratio"] != 1.0:
        return f"target_ratio={proto['target_ratio']:g}/interval={proto['interval']}"
    return f"interval={proto['interval']}"


PROTOCOL = Protocol(
    "interval",
    params={
        "interval": Param(int, 1, "compress every N steps down to B - 1 keys (peak B + N - 1)",
                          low=1, high=2**31, expect="an integer >= 1"),
        "target_ratio": Param(float, 1.0, "compress to this kept fraction of the tokens "
                              "seen, every `interval` steps",
                              check=lambda v: 0.0 < v <= 1.0, expect="a number in (0, 1]"),
    },
    asked=lambda proto: ("target_ratio" if proto["target_ratio"] != 1.0
                         else "interval" if proto["interval"] != 1 else None),
    label=_label,
    check=_check,
    extra=lambda proto: None if proto["target_ratio"] != 1.0 else proto["interval"] - 1,
    drive=_batched,
    capacity=_capacity,
)
