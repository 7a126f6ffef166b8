"""``page = S``: eviction in whole pages of ``S`` positions (DESIGN section 9), as a paged
serving engine holds the cache: at most ``floor(B / S)`` pages, the receiving one included.
A page's score is its keys' current scores reduced (``page_reduce``: the mean over ``S``,
or the max); a page holding a protected key (sinks, the recent part of ``B``) stays. The
policy starts with the whole prompt, so that every prompt key has its prefill score.
Shared by the simulator (:func:`paged`) and a model's layer stepper (:func:`page_prefill`,
:func:`page_evict`); with ``heads = "uniform"`` a layer's pages are ranked by its summed
scores (:mod:`kvsim.protocols.uniform`).
"""

from __future__ import annotations

import numpy as np

from kvsim.numerics.decode import Outputs
from kvsim.params import Param
from kvsim.policies.base import Group, Policy
from kvsim.protocols.base import Protocol, every_key
from kvsim.protocols.cache import Run, protected


def paged(run: Run, group: Group, out: Outputs, S: int, reduce: str, B: int) -> None:
    """Whole pages of ``S`` positions, at most ``floor(B / S)`` held (the receiving page
    included): the prefill keeps the protected pages, the receiving one and the best
    complete ones; a key that opens a page when the cap is reached evicts the
    lowest-ranked complete unprotected page first."""
    P, T = group.prompt_len, group.T
    page_prefill(run, P, S, reduce, B, group.seed)
    t = P
    while t < T:
        stop = min(t + (-t) % S, T) if t % S else t  # the next key that opens a page
        if stop > t:
            run.span(group, out, t, stop)
            t = stop
        if t < T:
            page_evict(run, t, S, reduce, B, group.seed)
            stop = min(t + S, T)
            run.span(group, out, t, stop)
            t = stop


def page_prefill(run: Run, P: int, S: int, reduce: str, B: int, seed: int) -> None:
    """The prefill of :func:`paged`: of the ``P`` prompt keys, the pages holding protected
    keys (the ``recent`` newest among them), the receiving page and the best complete
    others, ``floor(B / S)`` pages in all."""
    cap = B // S
    pages, score, guard = run.page_scores(S, reduce, -1, seed)
    recent = run.state.recent if run.policy.layout.recent is not None else 0
    guard |= np.isin(pages, np.unique(np.arange(max(P - recent, 0), P) // S))
    if P % S:
        guard |= pages == (P - 1) // S  # the receiving page
    if guard.sum() > cap:
        raise protected(run.policy, f"the {cap} pages of B = {B}")
    free = np.flatnonzero(~guard)
    best = free[np.lexsort((pages[free], -score[free]))][:cap - int(guard.sum())]
    run.drop_pages(np.setdiff1d(pages, pages[np.concatenate((np.flatnonzero(guard), best))]), S)


def page_evict(run: Run, t: int, S: int, reduce: str, B: int, seed: int) -> None:
    """Before key ``t`` opens a page: when ``floor(B / S)`` pages are held, the
    lowest-ranked unprotected one (the later page first among equals) leaves."""
    pages, score, guard = run.page_scores(S, reduce, t, seed)
    if pages.size >= B // S:
        free = np.flatnonzero(~guard)
        if free.size == 0:
            raise protected(run.policy, f"the {B // S} pages of B = {B}")
        worst = free[np.lexsort((-pages[free], score[free]))][0]
        run.drop_pages(pages[worst:worst + 1], S)


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
                f"below the {cap} pages of B = {budget}")
    return None


def _check(policy: Policy, proto: dict, params: dict, budget: int, P: int, T: int) -> str | None:
    layout = policy.layout
    if policy.steps.rank is None and not layout.position_rule:
        return (f"{policy.name} takes no page: it gives no per-key scores to reduce per page "
                f"(Steps.rank)")
    return _page_problem(proto["page"], layout.recent_count(budget, params),
                         layout.sinks(params), budget, P)


PROTOCOL = Protocol(
    "page",
    params={
        "page": Param(int, 1, "evict whole pages of S positions (at most floor(B / S) pages "
                      "held)", low=1, high=2**31, expect="an integer >= 1"),
        "page_reduce": Param(str, "mean", "a page's score from its keys' scores",
                             choices=("mean", "max")),
    },
    asked=lambda proto: "page" if proto["page"] != 1 else None,
    label=lambda proto: f"page={proto['page']}/{proto['page_reduce']}",
    check=_check,
    drive=lambda run, group, out, budget, proto, params: paged(
        run, group, out, proto["page"], proto["page_reduce"], budget),
    capacity=every_key,
    start_whole=True,
    steps_in_model=True,
)
