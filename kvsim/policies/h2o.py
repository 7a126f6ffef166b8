"""``h2o`` (online, accumulated scores) and ``h2o_offline`` (clairvoyant global scores).

Zhang et al. 2023, Heavy-Hitter Oracle: keep the ``recent`` newest tokens and the
heavy hitters, the keys with the largest accumulated attention.
"""

import numpy as np

from kvsim.numerics import kernels
from kvsim.policies.base import Group, Param, Policy, Trace, run_decode

RECENT_RATIO = Param(float, 0.5, "share of the budget kept for the newest tokens",
                     check=lambda v: 0.0 <= v < 1.0, expect="a number in [0, 1)")

ONLINE_PARAMS = {
    "recent_ratio": RECENT_RATIO,
    "normalize": Param(bool, False, "rank by score / number of queries that saw the key"),
    "accumulate": Param(str, "observed", "add the observed (renormalised) or the full attention",
                        choices=("observed", "full")),
}


def recent_count(budget: int, params: dict) -> int:
    """Number of newest tokens protected from eviction."""
    return int(params["recent_ratio"] * budget)


def _prefill(group: Group, budget: int, recent: int, ranking: np.ndarray) -> np.ndarray:
    P = group.prompt_len
    if P <= budget:
        return np.arange(P)
    heavy = kernels.top_ranked(ranking, 0, P - recent, budget - recent)
    return np.concatenate((heavy, np.arange(P - recent, P)))


def _online_ranking(group: Group, params: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt scores, queries that saw each key, the ranking score) of the prompt keys."""
    P = group.prompt_len
    score = group.prompt_scores()[:P]
    seen = (P - np.arange(P)).astype(np.float64)
    return score, seen, score / seen if params["normalize"] else score


def _run_online(group: Group, budget: int, params: dict, recent: int | None = None) -> Trace:
    recent = recent_count(budget, params) if recent is None else recent
    score, seen, ranking = _online_ranking(group, params)
    kept = _prefill(group, budget, recent, ranking)
    update = (kernels.UPDATE_ADD_OBSERVED if params["accumulate"] == "observed"
              else kernels.UPDATE_ADD_FULL)
    return run_decode(group, budget, kept, score=score[kept], seen=seen[kept],
                      evict_rule=kernels.EVICT_LOWEST, recent=recent,
                      normalize=params["normalize"], update_rule=update)


def _run_offline(group: Group, budget: int, params: dict, recent: int | None = None) -> Trace:
    recent = recent_count(budget, params) if recent is None else recent
    score = group.global_scores()
    kept = _prefill(group, budget, recent, score)
    return run_decode(group, budget, kept, score=score[kept], static_score=score,
                      evict_rule=kernels.EVICT_LOWEST, recent=recent)


# Budget allocation: the recent tokens are the fixed part, the older prompt keys selectable.
def _fixed(budget: int, prompt_len: int, params: dict) -> int:
    return recent_count(budget, params)


def _online_prefill_score(group: Group, budget: int, params: dict) -> np.ndarray:
    return _online_ranking(group, params)[2][:group.prompt_len - recent_count(budget, params)]


def _offline_prefill_score(group: Group, budget: int, params: dict) -> np.ndarray:
    return group.global_scores()[:group.prompt_len - recent_count(budget, params)]


ONLINE = Policy("h2o", "recent newest + heavy hitters by accumulated observed attention",
                ONLINE_PARAMS, _run_online, fixed=_fixed, prefill_score=_online_prefill_score,
                run_capped=lambda group, cap, budget, params: _run_online(
                    group, cap, params, recent_count(budget, params)))
OFFLINE = Policy("h2o_offline", "recent newest + heavy hitters by global column sums "
                 "(clairvoyant)", {"recent_ratio": RECENT_RATIO}, _run_offline, fixed=_fixed,
                 prefill_score=_offline_prefill_score,
                 run_capped=lambda group, cap, budget, params: _run_offline(
                     group, cap, params, recent_count(budget, params)))
