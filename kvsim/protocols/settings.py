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

HEADS = ("per_head", "uniform")
FILTERING = ("off", "per_head", "majority")
"""``heads``: a ranking per KV head (the default), or one for a whole layer."""

PROTOCOL_PARAMS: dict[str, Param] = {
    "interval": Param(int, 1, "compress every N steps down to B - 1 keys (peak B + N - 1)",
                      low=1, high=2**31, expect="an integer >= 1"),
    "target_ratio": Param(float, 1.0, "compress to this kept fraction of the tokens seen, "
                          "every `interval` steps", check=lambda v: 0.0 < v <= 1.0,
                          expect="a number in (0, 1]"),
    "page": Param(int, 1, "evict whole pages of S positions (at most floor(B / S) pages held)",
                  low=1, high=2**31, expect="an integer >= 1"),
    "page_reduce": Param(str, "mean", "a page's score from its keys' scores", choices=("mean", "max")),
    "threshold": Param(float, None, "keep a key leaving the window for good iff its score >= "
                       "this (append-only; no budget)"),
    "threshold_window": Param(int, 128, "the newest keys always held under a threshold", low=1,
                              high=2**31, expect="an integer >= 1"),
    "question_len": Param(int, 0, "the prompt's last Q tokens are the question", low=0,
                          high=2**31, expect="an integer >= 0"),
    "compress": Param(str, "after_question", "compress the prompt before or after the question",
                      choices=COMPRESS),
    "filtering": Param(str, "off", "append-only keep-or-drop of each decode key: per KV head "
                       "(kvpress FilteringPress) or by the layer's majority "
                       "(UniformFilteringPress)", choices=FILTERING),
    "filter_ratio": Param(float, 0.5, "the fraction of the tokens seen a filter removes "
                          "(kvpress's target_compression_ratio)",
                          check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)"),
    "heads": Param(str, "per_head", "one ranking per KV head, or one for every KV head of a "
                   "layer (the sum of their scores)", choices=HEADS),
}
"""Protocol settings, with their neutral defaults (the per-step rule)."""


def split(params: dict) -> tuple[dict, dict]:
    """``(policy parameters, protocol settings with defaults filled in)`` of ``params``."""
    own = {k: v for k, v in params.items() if k not in PROTOCOL_PARAMS}
    proto = {k: params.get(k, p.default) for k, p in PROTOCOL_PARAMS.items()}
    return own, proto


def is_neutral(proto: dict) -> bool:
    """True when the settings give exactly the per-step rule."""
    return (proto["interval"] == 1 and proto["target_ratio"] == 1.0 and proto["page"] == 1
            and proto["threshold"] is None and proto["heads"] == "per_head"
            and proto["filtering"] == "off"
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
    if proto["page"] != 1:
        parts.append(f"page={proto['page']}/{proto['page_reduce']}")
    if proto["threshold"] is not None:
        parts.append(f"threshold={proto['threshold']:g}/window={proto['threshold_window']}")
    if before_question(proto):
        parts.append(f"before_question(Q={proto['question_len']})")
    if proto["heads"] != "per_head":
        parts.append(f"heads={proto['heads']}")
    if proto["filtering"] != "off":
        parts.append(f"filtering={proto['filtering']}/ratio={proto['filter_ratio']:g}")
    return "+".join(parts) or "per_step"


def is_threshold(protocol: str) -> bool:
    """Whether a results ``protocol`` (:func:`label`) keeps keys by a threshold: its runs
    have no budget."""
    return any(part.startswith("threshold=") for part in protocol.split("+"))


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
    named = asked(params)
    if not policy.budgeted or policy.steps is None or policy.run_budgets is not None:
        return named[0], (f"{policy.name} takes no protocol ({named[0]}): it has no per-step "
                          f"eviction to batch, page or delay")
    layout = policy.layout
    if layout is None:
        return named[0], (f"{policy.name} takes no protocol ({named[0]}): it declares no state "
                          f"layout (Policy.layout) for the protocol to move")
    if len(named) > 1 and named not in (["interval", "question_len"], ["page", "heads"]):
        return named[1], (f"expected one protocol (only question_len combines with interval, "
                          f"and heads with page), got {' and '.join(named)}")
    if params.get("refresh"):
        return "refresh", (f"expected refresh = 0 with a protocol ({named[0]}): refresh is "
                           f"itself a decode-time compression protocol")
    position_rule = layout.position_rule
    if "filtering" in named and (policy.steps.rank is None or position_rule):
        return "filtering", (f"{policy.name} takes no filtering: "
                             + ("a position rule keeps no key for its score" if position_rule
                                else "it gives no per-key scores to judge (Steps.rank)"))
    if "heads" in named and (policy.steps.rank is None or position_rule
                             or policy.name == "random"):
        return "heads", (f"{policy.name} takes no heads = \"uniform\": "
                         + ("a position rule already decides alike for every KV head"
                            if position_rule else "its random orders, seeded per KV head, "
                            "have no sum to rank a layer by" if policy.name == "random"
                            else "it gives no per-key scores to sum over the layer's KV heads "
                            "(Steps.rank)"))
    if "page" in named:
        if policy.steps.rank is None and not position_rule:
            return "page", (f"{policy.name} takes no page: it gives no per-key scores to reduce "
                            f"per page (Steps.rank)")
        reason = _page_problem(proto["page"], layout.recent_count(budget, params),
                               layout.sinks(params), budget, prompt_len)
        if reason:
            return "page", reason
    if "threshold" in named and (policy.steps.rank is None or position_rule):
        return "threshold", (f"{policy.name} takes no threshold: "
                             + ("a position rule keeps no key for its score" if position_rule
                                else "it gives no per-key scores to judge (Steps.rank)"))
    if proto["target_ratio"] != 1.0:
        first = prompt_len + proto["interval"] - 1  # the first compression step
        if first < T:
            target = max(1, int(proto["target_ratio"] * (first + 1)))
            fixed = max(policy.fixed(budget, prompt_len, params), layout.sinks(params),
                        layout.recent_count(budget, params))
            if policy.steps.rank is None and not position_rule:
                fixed = budget - 1  # keys pinned at the prefill may all be protected
            if fixed >= target:
                return "target_ratio", (
                    f"expected a target above {policy.name}'s protected keys (up to {fixed} "
                    f"at B = {budget}), got {target} keys at the first compression "
                    f"(t = {first})")
    return None


def asked(params: dict) -> list[str]:
    """The protocols ``params`` asks for (not neutral), by their first setting's name."""
    _, proto = split(params)
    out = []
    if proto["interval"] != 1 or proto["target_ratio"] != 1.0:
        out.append("target_ratio" if proto["target_ratio"] != 1.0 else "interval")
    if proto["page"] != 1:
        out.append("page")
    if proto["threshold"] is not None:
        out.append("threshold")
    if before_question(proto):
        out.append("question_len")
    if proto["heads"] != "per_head":
        out.append("heads")
    if proto["filtering"] != "off":
        out.append("filtering")
    return out


def _pages(positions, S: int) -> set:
    return {k // S for k in positions}


def _page_problem(S: int, recent: int, n_sinks: int, budget: int,
                  prompt_len: int) -> str | None:
    """Why pages of ``S`` cannot work at ``budget``: fewer than 2 pages, or the protected
    positions (the ``recent`` newest, ``n_sinks`` sinks) spanning every page that may be
    held."""
    cap = budget // S
    if budget < 2 * S:
        return f"expected a budget of at least 2 pages (2 * page = {2 * S}), got B = {budget}"
    sinks = _pages(range(n_sinks), S)
    P = prompt_len
    at_prefill = _pages(range(max(P - recent, 0), P), S) | _pages(range(min(P, n_sinks)), S)
    if P % S:
        at_prefill.add((P - 1) // S)
    at_decode = len(sinks) + -(-max(recent - 1, 0) // S)
    if len(at_prefill) > cap or at_decode >= cap:
        return (f"expected protected pages (recent {recent}, sinks {n_sinks}) "
                f"below the {cap} pages of B = {budget} with page = {S}")
    return None
