"""The protocol settings that any policy configuration may carry, and their checks.

A protocol says when a policy compresses and with which queries; it composes with every
policy that has step code (``Policy.steps``) and evicts under a budget, whatever its
ranking. Settings live beside a policy's own parameters (``interval = 16`` in a
``[policies.NAME]`` table, or in the ``params`` of :func:`kvsim.simulate`); a setting
left at its neutral value runs the policy's per-step rule unchanged.
"""

from __future__ import annotations

from kvsim.params import Param
from kvsim.protocols.question import COMPRESS

PROTOCOL_PARAMS: dict[str, Param] = {
    "interval": Param(int, 1, "compress every N steps down to B - 1 keys (peak B + N - 1)",
                      low=1, high=2**31, expect="an integer >= 1"),
    "target_ratio": Param(float, 1.0, "compress to this kept fraction of the tokens seen, "
                          "every `interval` steps", check=lambda v: 0.0 < v <= 1.0,
                          expect="a number in (0, 1]"),
    "question_len": Param(int, 0, "the prompt's last Q tokens are the question", low=0,
                          high=2**31, expect="an integer >= 0"),
    "compress": Param(str, "after_question", "compress the prompt before or after the question",
                      choices=COMPRESS),
}
"""Protocol settings, with their neutral defaults (the per-step rule)."""


def split(params: dict) -> tuple[dict, dict]:
    """``(policy parameters, protocol settings with defaults filled in)`` of ``params``."""
    own = {k: v for k, v in params.items() if k not in PROTOCOL_PARAMS}
    proto = {k: params.get(k, p.default) for k, p in PROTOCOL_PARAMS.items()}
    return own, proto


def is_neutral(proto: dict) -> bool:
    """True when the settings give exactly the per-step rule."""
    return (proto["interval"] == 1 and proto["target_ratio"] == 1.0
            and (proto["question_len"] == 0 or proto["compress"] == "after_question"))


def before_question(proto: dict) -> int:
    """The question length ``Q`` that joins without eviction (0 after the question)."""
    return proto["question_len"] if proto["compress"] == "before_question" else 0


def label(params: dict) -> str:
    """The protocol of a configuration in words, for results: ``per_step``,
    ``interval=16``, ``target_ratio=0.25/interval=16``, ``before_question(Q=32)``, joined
    with ``+``."""
    _, proto = split(params)
    parts = []
    if proto["target_ratio"] != 1.0:
        parts.append(f"target_ratio={proto['target_ratio']:g}/interval={proto['interval']}")
    elif proto["interval"] != 1:
        parts.append(f"interval={proto['interval']}")
    if before_question(proto):
        parts.append(f"before_question(Q={proto['question_len']})")
    return "+".join(parts) or "per_step"


def problem(policy, params: dict, budget: int, prompt_len: int, T: int) -> tuple[str, str] | None:
    """``(key, message)`` if ``policy`` cannot take the protocol of ``params`` at ``budget``
    on a prompt of ``prompt_len`` of ``T`` tokens; None if it can (or it is neutral).

    Every check that a run would otherwise fail is here, so that what a scenario check
    accepts runs.
    """
    _, proto = split(params)
    if proto["question_len"] > prompt_len:
        return "question_len", (f"expected at most prompt_len = {prompt_len}, got "
                                f"{proto['question_len']}")
    if is_neutral(proto):
        return None
    given = ", ".join(k for k in PROTOCOL_PARAMS if k in params and k != "compress") or "compress"
    if not policy.budgeted or policy.steps is None or policy.run_budgets is not None:
        return given.split(", ")[0], (f"{policy.name} takes no protocol ({given}): it has no "
                                      f"per-step eviction to batch or delay")
    if params.get("refresh"):
        return "refresh", (f"expected refresh = 0 with a protocol ({given}): refresh is "
                           f"itself a decode-time compression protocol")
    fixed = policy.fixed(budget, prompt_len, params)
    if proto["target_ratio"] != 1.0:
        first = prompt_len + proto["interval"] - 1  # the first compression step
        if first < T:
            target = max(1, int(proto["target_ratio"] * (first + 1)))
            if fixed > target:
                return "target_ratio", (
                    f"expected a target above {policy.name}'s protected keys ({fixed} at "
                    f"B = {budget}), got {target} keys at the first compression (t = {first})")
    return None
