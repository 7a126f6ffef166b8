"""The protocol registry: every protocol's settings, and what a run reads from them.

A protocol says when a policy compresses and with which queries; it composes with every
policy that has step code (``Policy.steps``) and evicts under a budget, whatever its
ranking. Settings live beside a policy's own parameters (``interval = 16`` in a
``[policies.NAME]`` table, or in the ``params`` of :func:`kvsim.simulate`); a setting
left at its neutral value runs the policy's per-step rule unchanged.

Each protocol is one module declaring a :class:`~kvsim.protocols.base.Protocol`;
:data:`PROTOCOLS` lists them (their order is that of results' ``protocol`` labels) and
:func:`register` adds one at run time (docs/adding-a-protocol.md).
"""

from __future__ import annotations

from kvsim.params import Param
from kvsim.policies.base import Policy
from kvsim.protocols import filtering, interval, pages, question, threshold, uniform
from kvsim.protocols.base import Protocol

PROTOCOLS: list[Protocol] = [interval.PROTOCOL, pages.PROTOCOL, threshold.PROTOCOL,
                             question.PROTOCOL, uniform.PROTOCOL, filtering.PROTOCOL]
"""The registered protocols, in label order."""

PROTOCOL_PARAMS: dict[str, Param] = {k: p for proto in PROTOCOLS for k, p in proto.params.items()}
"""Every protocol setting, with its neutral default (the per-step rule)."""


def register(protocol: Protocol) -> Protocol:
    """Add ``protocol`` to the registry (after the built-in ones); its settings then fit every
    policy configuration."""
    if protocol in PROTOCOLS:
        return protocol
    clash = set(protocol.params) & set(PROTOCOL_PARAMS)
    if clash:
        raise ValueError(f"protocol settings {sorted(clash)} are registered already")
    PROTOCOLS.append(protocol)
    PROTOCOL_PARAMS.update(protocol.params)
    return protocol


def split(params: dict) -> tuple[dict, dict]:
    """``(policy parameters, protocol settings with defaults filled in)`` of ``params``."""
    own = {k: v for k, v in params.items() if k not in PROTOCOL_PARAMS}
    proto = {k: params.get(k, p.default) for k, p in PROTOCOL_PARAMS.items()}
    return own, proto


def chosen(proto: dict) -> list[tuple[str, Protocol]]:
    """``(setting, protocol)`` of each protocol that ``proto`` asks for, in registry order."""
    return [(name, p) for p in PROTOCOLS if (name := p.asked(proto)) is not None]


def is_neutral(proto: dict) -> bool:
    """True when the settings give exactly the per-step rule."""
    return not chosen(proto)


def asked(params: dict) -> list[str]:
    """The protocols ``params`` asks for (not neutral), by the setting that names each."""
    return [name for name, _ in chosen(split(params)[1])]


def label(params: dict) -> str:
    """The protocol of a configuration in words, for results: ``per_step``,
    ``interval=16``, ``target_ratio=0.25/interval=16``, ``before_question(Q=32)``, joined
    with ``+``."""
    proto = split(params)[1]
    return "+".join(p.label(proto) for _, p in chosen(proto)) or "per_step"


def peak_limit(budget: int, params: dict, T: int) -> int:
    """The most keys a run at ``budget`` may hold at once under the protocol of ``params``."""
    proto = split(params)[1]
    extra = [p.extra(proto) for _, p in chosen(proto)]
    return T if None in extra else budget + sum(extra)


def steps_in_model(params: dict) -> bool:
    """Whether a model's layer stepper runs the protocol of ``params`` (it asks for one)."""
    found = chosen(split(params)[1])
    return bool(found) and all(p.steps_in_model for _, p in found)


def in_model() -> list[str]:
    """The settings (``asked`` names) of the protocols a model's layer stepper runs."""
    return [p.name for p in PROTOCOLS if p.steps_in_model]


def layer_wide(params: dict) -> bool:
    """Whether the protocol of ``params`` decides for every KV head of a layer at once."""
    proto = split(params)[1]
    return any(p.layer_wide(proto) for _, p in chosen(proto))


def _combinations() -> str:
    pairs = [(p.name, other) for p in PROTOCOLS for other in p.combines]
    return ", and ".join(f"{a} combines with {b}" if i == 0 else f"{a} with {b}"
                         for i, (a, b) in enumerate(pairs))


def _combine(a: tuple[str, Protocol], b: tuple[str, Protocol]) -> bool:
    return a[0] in b[1].combines or b[0] in a[1].combines


def problem(policy: Policy, params: dict, budget: int, prompt_len: int, T: int) -> tuple[str, str] | None:
    """``(key, message)`` if ``policy`` cannot take the protocol of ``params`` at ``budget``
    on a prompt of ``prompt_len`` of ``T`` tokens; None if it can (or it is neutral).

    Every check that a run would otherwise fail is here, so that what a scenario check
    accepts runs.
    """
    proto = split(params)[1]
    if proto["question_len"] > prompt_len:
        return "question_len", (f"expected at most prompt_len = {prompt_len}, got "
                                f"{proto['question_len']}")
    found = chosen(proto)
    if not found:
        return None
    named = [name for name, _ in found]
    if not policy.budgeted or policy.steps is None or policy.run_budgets is not None:
        return named[0], (f"{policy.name} takes no protocol ({named[0]}): it has no per-step "
                          f"eviction to batch, page or delay")
    if policy.layout is None:
        return named[0], (f"{policy.name} takes no protocol ({named[0]}): it declares no state "
                          f"layout (Policy.layout) for the protocol to move")
    for i, one in enumerate(found):
        for other in found[i + 1:]:
            if not _combine(one, other):
                return other[0], (f"expected one protocol (only {_combinations()}), got "
                                  f"{' and '.join(named)}")
    if params.get("refresh"):
        return "refresh", (f"expected refresh = 0 with a protocol ({named[0]}): refresh is "
                           f"itself a decode-time compression protocol")
    for name, p in found:
        reason = p.check and p.check(policy, proto, params, budget, prompt_len, T)
        if reason:
            return name, reason
    return None
