"""``expected_attention``: the attention that future queries are expected to pay a key
(kvpress ``ExpectedAttentionPress`` at commit 8bb29b9; Devoto et al. 2025).

Per query head, the pre-RoPE queries of the prompt after the ``n_sink`` first give a mean
``mu`` and a covariance ``S`` (divided by their count ``N``). ``Rbar`` is the mean of the
RoPE matrices of the ``n_future`` positions after the prompt, so ``mu' = Rbar mu`` and
``S' = Rbar S Rbar^T`` describe a future query's distribution. For a post-RoPE key ``k``,
``z = mu' . k / sqrt(d) + k^T S' k / (2 d)`` is the log of its expected exponentiated
logit; a key's score is the softmax of ``z`` over the keys after the sinks, combined over
the group's heads by ``gqa``, times ``||v||``. The ``n_sink`` first positions are always
kept. Prefill keeps the top ``B``.

Decode (one step at a time): the prefill's statistics stay; a key is scored when it
joins, on the prompt's softmax normaliser (so a prompt key keeps exactly its prefill
score), and when full the lowest-scored key goes (:mod:`kvsim.policies.scored`).
:func:`rescore` is the re-scoring of a compression every ``N`` decode steps from the decode
queries since the last one (kvpress's ``DecodingPress``).
"""

from __future__ import annotations

import functools

import numpy as np

from kvsim.errors import Problem
from kvsim.numerics.decode import observe_nothing
from kvsim.numerics.jit import jit
from kvsim.params import Param
from kvsim.policies import scored
from kvsim.policies.base import Group, Policy, Presentation, Steps
from kvsim.policies.layout import StateLayout

BUFFER = 256  # decode queries a re-score reads at most (kvpress's hidden-states buffer)


def averaged_rope(freq: np.ndarray, scale: float, d: int, start: int, n_future: int
                  ) -> np.ndarray:
    """(d, d) mean over positions ``start .. start + n_future - 1`` of the RoPE matrix
    (rotate-half layout: dimension ``i < n`` pairs with ``i + n``, ``n = len(freq)``;
    dimensions from ``2 n`` on are not rotated), cos and sin times ``scale``."""
    n = freq.shape[0]
    angles = np.arange(start, start + n_future, dtype=np.float64)[:, None] * freq[None, :]
    c = (scale * np.cos(angles)).mean(axis=0)
    s = (scale * np.sin(angles)).mean(axis=0)
    R = np.eye(d)
    i = np.arange(n)
    R[i, i], R[i + n, i + n] = c, c
    R[i, i + n], R[i + n, i] = -s, s
    return R


def future_query(pre_q: np.ndarray, R: np.ndarray, covariance: bool
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Mean (G, d) and covariance (G, d, d) of the pre-RoPE queries ``pre_q`` (G, N, d),
    divided by ``N``, rotated by ``R``: ``R mu`` and ``R S R^T`` (zero without
    ``covariance``)."""
    q = pre_q.astype(np.float64)
    mu = q.mean(axis=1)
    cov = np.zeros((q.shape[0], q.shape[2], q.shape[2]))
    if covariance:
        centred = q - mu[:, None, :]
        cov = np.einsum("gsi,gsj->gij", centred, centred) / q.shape[1]
    return mu @ R.T, R @ cov @ R.T


def expected_logits(mu: np.ndarray, cov: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """(G, n) ``z = mu . k / sqrt(d) + k^T cov k / (2 d)`` of the keys (n, d), computed
    key by key in a fixed order (equal keys get equal ``z``, however many are scored)."""
    return _expected_logits(np.ascontiguousarray(mu, np.float64),
                            np.ascontiguousarray(cov, np.float64),
                            np.ascontiguousarray(keys, np.float64))


@jit
def _expected_logits(mu, cov, k):
    G, n, d = mu.shape[0], k.shape[0], k.shape[1]
    z = np.empty((G, n))
    root = np.sqrt(d)
    for g in range(G):
        for s in range(n):
            linear = 0.0
            quadratic = 0.0
            for i in range(d):
                linear += k[s, i] * mu[g, i]
                row = 0.0
                for j in range(d):
                    row += cov[g, i, j] * k[s, j]
                quadratic += row * k[s, i]
            z[g, s] = linear / root + quadratic / d / 2
    return z


def scores(group: Group, pre_q: np.ndarray, keys: np.ndarray, values: np.ndarray,
           start: int, params: dict) -> np.ndarray:
    """Expected-attention scores of ``keys`` (n, d) with ``values`` (n, dv) from the
    queries ``pre_q`` (G, N, d), future positions from ``start``, the softmax over these
    keys."""
    f = group.field
    R = averaged_rope(f.rope_freq, f.rope_scale, keys.shape[1], start, params["n_future"])
    mu, cov = future_query(pre_q, R, params["covariance"])
    z = expected_logits(mu, cov, keys)
    return _weighted(group, z, softmax_norm(z), values, params)


def _weighted(group: Group, z: np.ndarray, norm: tuple, values: np.ndarray, params: dict
              ) -> np.ndarray:
    """Per head ``exp(z - max) / sum`` with the per-head (max, sum) ``norm``, combined over
    the group by its ``gqa``, times ``||v||`` where ``vnorm``."""
    top, total = norm
    combined = group.combine([np.exp(z[g] - top[g]) / total[g] for g in range(z.shape[0])])
    if params["vnorm"]:
        v = values.astype(np.float64)
        combined = combined * np.sqrt((v * v).sum(axis=1))
    return combined


def softmax_norm(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per head, the softmax normaliser of ``z`` (G, n): its max and ``sum exp(z - max)``."""
    top = z.max(axis=1)
    return top, np.exp(z - top[:, None]).sum(axis=1)


def _prefill_model(group: Group, params: dict) -> tuple[np.ndarray, np.ndarray, tuple]:
    """The prefill's future-query mean and covariance and the prompt keys' softmax
    normaliser (computed once per KV head and parameters, whatever the budget)."""
    def compute():
        P, n_sink, f = group.prompt_len, params["n_sink"], group.field
        pre_q = f.pre_rope_queries[group.heads, n_sink:P]
        R = averaged_rope(f.rope_freq, f.rope_scale, pre_q.shape[2], P, params["n_future"])
        mu, cov = future_query(pre_q, R, params["covariance"])
        return mu, cov, softmax_norm(expected_logits(mu, cov, group.keys[:, n_sink:P].T))

    return group.shared(("expected_attention", *sorted(params.items())), compute)


def score(group: Group, lo: int, hi: int, params: dict) -> np.ndarray:
    """Static scores of positions ``lo .. hi-1``: ``+inf`` for the sinks, else the
    prefill's expected attention (on the prompt keys' softmax normaliser) times ``||v||``."""
    n_sink = params["n_sink"]
    out = np.full(hi - lo, np.inf)
    first = max(lo, n_sink)
    if first >= hi:
        return out
    mu, cov, norm = _prefill_model(group, params)
    z = expected_logits(mu, cov, group.keys[:, first:hi].T)
    out[first - lo:] = _weighted(group, z, norm, group.values[first:hi], params)
    return out


def rescore(group: Group, cache: np.ndarray, t: int, since: int, params: dict) -> np.ndarray:
    """Scores of the cached positions ``cache`` at a decode-time compression just before
    token ``t`` joins (the interval protocol, ``interval = N > n_sink``): the query
    statistics come from the decode queries ``since .. t-1`` (those since the last
    compression), the last :data:`BUFFER` at most and the first ``n_sink`` of those
    dropped; future positions count from ``t``; the softmax runs over the cached positions
    ``>= n_sink``, which get ``+inf`` (always kept). Rank with the total order."""
    n_sink = params["n_sink"]
    queries = np.arange(max(since, t - BUFFER), t)[n_sink:]
    if queries.size == 0:
        raise ValueError(f"expected_attention: no decode query to re-score from (queries "
                         f"{since}..{t - 1}, the first {n_sink} dropped)")
    cache = np.asarray(cache, np.int64)
    out = np.full(cache.shape[0], np.inf)
    rest = cache >= n_sink
    if not rest.any():
        return out
    pre_q = group.field.pre_rope_queries[group.heads][:, queries]
    out[rest] = scores(group, pre_q, group.keys[:, cache[rest]].T, group.values[cache[rest]],
                       t, params)
    return out


def interval_scores(group: Group, cache: np.ndarray, t: int, since: int, params: dict
                    ) -> np.ndarray | None:
    """:func:`rescore` where a decode query is left once the first ``n_sink`` are dropped
    (``interval = N > n_sink``); None otherwise: the prefill's scores rank the cache."""
    if max(since, t - BUFFER) + params["n_sink"] >= t:
        return None
    return rescore(group, cache, t, since, params)


def _check(T: int, prompt_len: int, params: dict) -> Problem | None:
    seen = prompt_len  # the prompt compressed at the prefill (before the question, if so)
    if params.get("compress") == "before_question":
        seen -= params.get("question_len", 0)
    if seen <= params["n_sink"] and (seen < prompt_len or prompt_len < T):
        return Problem("n_sink", f"expected fewer sinks than the {seen} prompt tokens it "
                                 f"compresses (the query statistics come from the prompt "
                                 f"queries after the sinks), got {params['n_sink']}")
    return None


POLICY = Policy(
    "expected_attention", "kvpress's Expected Attention: softmax of the expected logit of a "
    "future query (pre-RoPE query mean and covariance under the averaged RoPE of the next "
    "positions) times ||v||; sinks kept",
    {"n_sink": Param(int, 4, "first positions always kept, their queries left out", low=0),
     "n_future": Param(int, 512, "future positions whose RoPE is averaged", low=1),
     "covariance": Param(bool, True, "add the query covariance term k^T S' k / (2d)"),
     "vnorm": Param(bool, True, "multiply the score by ||v||")},
    Steps(functools.partial(scored.start, score, recent=0), scored.admit,
          observe_nothing, scored.decode, functools.partial(scored.prepare, score)),
    min_budget=lambda params: params["n_sink"] + 1, check=_check,
    floor_reason="n_sink + 1: the sinks are always kept",
    needs=frozenset({"keys", "values", "rope"}),
    fixed=lambda budget, prompt_len, params: params["n_sink"], rescore=interval_scores,
    presentation=Presentation(
        family="expected query", color="#fdb863", marker="P",
        reads="keys, values, pre-RoPE queries with RoPE settings",
        rule=("Expected Attention (kvpress `ExpectedAttentionPress` at commit `8bb29b9`; Devoto et al. "
              "2025): the softmax of a future query's expected logit, from the mean and covariance of the "
              "prompt's pre-RoPE queries under the RoPE averaged over the next `n_future` positions, times "
              "`‖v‖`; the first `n_sink` positions always kept")),
    layout=StateLayout(scored.SLOTS, slot_of=True, sinks=lambda params: params["n_sink"]))
