"""Plain-NumPy reference implementation of kvsim's eviction policies.

Written for clarity, not speed, straight from DESIGN.md (sections 2-4) and the
README's Semantics section. The cache is a Python list of positions, simulated
token by token. Used by the tests to check the jitted kernels exactly.

:data:`REFERENCES` (at the end) is the one table of the policy tests: an entry per
registered policy, keyed by its name, with its rule, its parameter variants and whether it
runs on GQA groups. Parameters reach a rule by name, with the registry's defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params

@dataclass
class RefResult:
    mass: np.ndarray  # float64 (T-P,)
    cache_size: np.ndarray  # int64 (T-P,)
    recall: np.ndarray | None  # float64 (T-P,) or None
    kept: np.ndarray  # sorted int64, the final cache
    final_recall: float | None
    near_tie: bool = False  # some decision hinged on a near tie (see NEAR_TIE_RTOL)


# ---------------------------------------------------------------- helpers


def rank(pos, score):
    """Sort key: higher score first, then lower position (the one total order)."""
    return (-score[pos], pos)


# Relative gap below which two *different* float scores count as a near tie: their
# order is decided by rounding noise (e.g. keys whose scores are equal in exact
# arithmetic), so another correct implementation may order them the other way.
NEAR_TIE_RTOL = 1e-12
_near_ties = []  # decisions with a near tie at the boundary, reset per simulation


def _note_boundary(a, b, what):
    if a != b and math.isfinite(a) and math.isfinite(b) and abs(a - b) <= NEAR_TIE_RTOL * max(abs(a), abs(b)):
        _near_ties.append((what, a, b))


def top_k(positions, score, k):
    """The k top-ranked positions, returned sorted by position."""
    ordered = sorted(positions, key=lambda q: rank(q, score))
    if 0 < k < len(ordered):
        _note_boundary(score[ordered[k - 1]], score[ordered[k]], "top_k")
    return sorted(ordered[:k])


def lowest_ranked(positions, score):
    """The lowest-ranked position: lowest score, then highest position."""
    ordered = sorted(positions, key=lambda q: rank(q, score))
    if len(ordered) >= 2:
        _note_boundary(score[ordered[-1]], score[ordered[-2]], "evict")
    return ordered[-1]


def cache_mass(p, t, cache):
    """mass(t) = sum_{k in C_t} p(t, k), summed in ascending position order."""
    total = 0.0
    for k in sorted(cache):
        total += p[t, k]
    return total


def observed(p, t, cache):
    """p~(t, k) = p(t, k) / mass(t) over the cache (all 0 when mass is 0)."""
    m = cache_mass(p, t, cache)
    return {k: (p[t, k] / m if m > 0 else 0.0) for k in cache}


def prompt_colsum(p, P):
    """Column sums of the prompt's full attention: sum_{q<P} p(q, k)."""
    return [sum_seq(p[k:P, k]) for k in range(P)]


def sum_seq(values):
    """Sequential float64 sum (fixed order, independent of numpy's pairwise sum)."""
    total = 0.0
    for v in values:
        total += float(v)
    return total


# ---------------------------------------------------------------- policies
# Each policy returns (prefill_selection, [C_t for t = P .. T-1]).


def policy_full(p, P, T, B):
    """Keep everything."""
    cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_window(p, P, T, B):
    """Last B tokens; evict the oldest."""
    cache = list(range(max(0, P - B), P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(min(cache))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_streaming_llm(p, P, T, B, sinks):
    """Keys 0..sinks-1 plus the newest B - sinks; evict the oldest non-sink."""
    if P > B:
        cache = list(range(sinks)) + list(range(P - (B - sinks), P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(min(k for k in cache if k >= sinks))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def _recent_count(recent_ratio, B):
    return int(math.floor(recent_ratio * B))


def policy_h2o(p, P, T, B, recent_ratio, normalize, accumulate, recent=None):
    """Online H2O: accumulated (optionally age-normalised) attention scores. ``recent``
    overrides the recent count (a budget-allocation cap keeps the fixed part of its mean B)."""
    r = _recent_count(recent_ratio, B) if recent is None else recent
    acc = {k: s for k, s in enumerate(prompt_colsum(p, P))}
    seen = {k: P - k for k in range(P)}

    def ranking_score():
        if normalize:
            return {k: acc[k] / seen[k] for k in acc}
        return dict(acc)

    if P > B:
        heavy = top_k(range(P - r), ranking_score(), B - r)
        cache = heavy + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            score = ranking_score()
            candidates = [k for k in cache if k <= t - r]  # the r newest include t
            cache.remove(lowest_ranked(candidates, score))
        cache.append(t)
        acc[t] = 0.0
        seen[t] = 0
        if accumulate == "observed":
            add = observed(p, t, cache)
        else:
            add = {k: p[t, k] for k in cache}
        for k in cache:
            acc[k] += add[k]
            seen[k] += 1
        steps.append(list(cache))
    return prefill, steps


def policy_h2o_offline(p, P, T, B, recent_ratio, recent=None):
    """Clairvoyant H2O: static scores = column sums over all T queries (``recent`` as for
    :func:`policy_h2o`)."""
    r = _recent_count(recent_ratio, B) if recent is None else recent
    score = [sum_seq(p[k:T, k]) for k in range(T)]
    if P > B:
        cache = top_k(range(P - r), score, B - r) + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            candidates = [k for k in cache if k <= t - r]  # the r newest include t
            cache.remove(lowest_ranked(candidates, score))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def pool_votes(votes, kernel, pooling):
    """1-D pooling, stride 1, half-width kernel//2, clipped to the candidates."""
    n = len(votes)
    h = kernel // 2
    out = []
    for k in range(n):
        seg = votes[max(0, k - h) : min(n - 1, k + h) + 1]
        if pooling == "max":
            out.append(max(seg))
        elif pooling == "avg":
            out.append(sum_seq(seg) / kernel)
        else:
            out.append(votes[k])
    return out


def policy_snapkv(p, P, T, B, window, kernel, pooling, protect_window):
    """SnapKV: pooled observation-window votes pin prefix keys; a ring holds the rest."""
    w = min(window, P)
    n_cand = P - w if protect_window else P
    votes = [sum_seq(p[P - w : P, k]) for k in range(n_cand)]
    pooled = pool_votes(votes, kernel, pooling)
    if not protect_window:
        # Only valid for P == T: top B of all prompt keys, no decode.
        cache = top_k(range(P), pooled, B) if P > B else list(range(P))
        return list(cache), []
    n_pin = min(P - w, B - w)
    pinned = top_k(range(P - w), pooled, n_pin)
    ring = list(range(P - w, P))  # oldest first
    capacity = B - n_pin
    prefill = sorted(pinned + ring)
    steps = []
    for t in range(P, T):
        if len(ring) == capacity:
            ring.pop(0)
        ring.append(t)
        steps.append(pinned + ring)
    return prefill, steps


def policy_tova(p, P, T, B):
    """TOVA: evict the key the previous query attended to least."""
    if P > B:
        cache = top_k(range(P), p[P - 1], B)
    else:
        cache = list(range(P))
    prefill = list(cache)
    prev = {k: p[P - 1, k] for k in cache}  # for t = P: full attention of P-1
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked(cache, prev))
        cache.append(t)
        prev = observed(p, t, cache)
        steps.append(list(cache))
    return prefill, steps


def policy_decayed(p, P, T, B, decay):
    """The per-step example of docs/adding-a-policy.md: TOVA's prefill, decayed scores."""
    cache = top_k(range(P), p[P - 1], B) if P > B else list(range(P))
    prefill = list(cache)
    score = {k: p[P - 1, k] for k in cache}
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked(cache, score))
        cache.append(t)
        step = observed(p, t, cache)
        score = {k: decay * score.get(k, 0.0) + step[k] for k in cache}
        steps.append(list(cache))
    return prefill, steps


def policy_random(p, P, T, B, seed):
    """Seeded random eviction over B slots; the new token takes the evicted slot."""
    rng = np.random.default_rng(seed)
    if P > B:
        selection = [int(x) for x in np.sort(rng.choice(P, B, replace=False))]
    else:
        selection = list(range(P))
    draws = rng.integers(0, B, size=T - P)
    slots = [None] * B
    for i, k in enumerate(selection):
        slots[i] = k
    prefill = list(selection)
    steps = []
    for i, t in enumerate(range(P, T)):
        if None in slots:
            slots[slots.index(None)] = t
        else:
            slots[int(draws[i])] = t
        steps.append([k for k in slots if k is not None])
    return prefill, steps


def policy_oracle(p, P, T, B):
    """Per step, the B keys with the largest full attention (no state)."""
    prefill = top_k(range(P), p[P - 1], B) if P > 0 else []
    steps = [top_k(range(t + 1), p[t], B) for t in range(P, T)]
    return prefill, steps


# ---------------------------------------------------------------- driver


def normalise_rows(attention):
    """float64 copy with every row divided by its sum."""
    a = np.asarray(attention, dtype=np.float64)
    return a / a.sum(axis=1, keepdims=True)


def reference_simulate(attention, policy, budget, prompt_len, important=None, seed=0, **params):
    """Reference run of ``policy`` on a dense (T, T) matrix (one query head), with the same
    fields as kvsim.simulate's result."""
    imp = None if important is None else sorted(set(int(i) for i in np.asarray(important).ravel()))
    run = reference_run(dense_source(attention), policy, budget, prompt_len, important=imp,
                        seed=seed, **params)
    final = None
    if imp is not None:
        final = len(set(run.kept.tolist()) & set(imp)) / len(imp) if imp else float("nan")
    return RefResult(run.mass[0], run.cache_size, run.recall, run.kept, final, run.near_tie)


# ================================================================ sources with vectors, GQA
# The policies of DESIGN.md section 6 (and the GQA combination) on a *source*: the G query
# heads sharing one KV head, with their full causal attention and, where the source has
# them, the query/key/value vectors. Everything below is plain Python over float64.



@dataclass
class Source:
    """One KV head: ``probs`` (G, T, T) full causal attention of its G query heads, and
    optionally ``keys`` (T, d), ``values`` (T, dv), ``queries`` (G, T, d) with the logit
    scale of each query head (the logit is ``scaling[g] * q . k``)."""

    probs: np.ndarray
    keys: np.ndarray | None = None
    values: np.ndarray | None = None
    queries: np.ndarray | None = None
    scaling: np.ndarray | None = None

    @property
    def G(self):
        return self.probs.shape[0]

    @property
    def T(self):
        return self.probs.shape[1]


def dense_source(probs):
    """A source from dense probabilities, (T, T) or (G, T, T): no vectors."""
    a = np.asarray(probs, dtype=np.float64)
    a = a[None] if a.ndim == 2 else a
    return Source(np.stack([normalise_rows(x) for x in a]))


def dot_seq(x, y):
    """sum_i x_i * y_i in float64, in order of i."""
    total = 0.0
    for a, b in zip(x, y):
        total += float(a) * float(b)
    return total


def qk_logits(queries, keys, scaling):
    """(G, T, T) logits ``scaling[g] * q . k``, the dot product summed over dimensions in
    order, as kvsim's q.k fields and traces define them."""
    q = np.asarray(queries, dtype=np.float64)
    k = np.asarray(keys, dtype=np.float64)
    G, T, d = q.shape
    dots = np.zeros((G, T, T))
    for i in range(d):  # one dimension at a time: the same float sum as kvsim
        dots += q[:, :, i, None] * k[None, None, :, i]
    return np.asarray(scaling, dtype=np.float64)[:, None, None] * dots


def causal_probs(logits):
    """Row softmax over keys k <= q (zero above the diagonal)."""
    T = logits.shape[-1]
    mask = np.tril(np.ones((T, T), dtype=bool))
    z = np.where(mask, logits, -np.inf)
    e = np.where(mask, np.exp(z - z.max(axis=-1, keepdims=True)), 0.0)
    return e / e.sum(axis=-1, keepdims=True)


def qk_source(queries, keys, values=None, scaling=None):
    """A source from query (G, T, d), key (T, d) and value (T, dv) vectors; ``scaling``
    (one per query head, default 1/sqrt(d)) multiplies q . k."""
    q = np.asarray(queries, dtype=np.float64)
    G, T, d = q.shape
    scaling = np.full(G, 1.0 / math.sqrt(d)) if scaling is None else np.asarray(scaling, float)
    k = np.asarray(keys, dtype=np.float64)
    v = None if values is None else np.asarray(values, dtype=np.float64)
    return Source(causal_probs(qk_logits(q, k, scaling)), k, v, q, scaling)


def combine(per_head, mode):
    """Combine one value per query head (in head order): mean, max or sum.

    Mean is the sum divided by the number of heads, as kvsim computes it."""
    total = per_head[0]
    for x in per_head[1:]:
        total = max(total, x) if mode == "max" else total + x
    return total / len(per_head) if mode == "mean" else total


def combined_scores(per_head, mode):
    """Combine per-head score dicts (same keys) into one dict."""
    return {k: combine([s[k] for s in per_head], mode) for k in per_head[0]}


def head_observed(src, t, cache):
    """Per query head, p~_g(t, k) over the cache (a dict per head)."""
    out = []
    for g in range(src.G):
        m = cache_mass(src.probs[g], t, cache)
        out.append({k: (src.probs[g, t, k] / m if m > 0 else 0.0) for k in cache})
    return out


def _note_threshold(value, bound, what):
    """A threshold comparison decided by rounding noise counts as a near tie."""
    _note_boundary(value, bound, what)


def l2_norm(x):
    """sqrt(sum_i x_i^2), summed in order of i."""
    return math.sqrt(dot_seq(x, x))


def _static_keep(score, P, T, B, r):
    """Keep the r newest + top B - r by a static score; evict the lowest outside the r newest."""
    cache = top_k(range(P - r), score, B - r) + list(range(P - r, P)) if P > B else list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked([k for k in cache if k <= t - r], score))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_knorm(src, P, T, B, gqa, recent_ratio):
    """Knorm: score = -||k||; static."""
    score = [-l2_norm(src.keys[k]) for k in range(T)]
    return _static_keep(score, P, T, B, _recent_count(recent_ratio, B))


def policy_vnorm(src, P, T, B, gqa, recent_ratio):
    """The example of docs/adding-a-policy.md: score = ||v||; static."""
    score = [l2_norm(src.values[k]) for k in range(T)]
    return _static_keep(score, P, T, B, _recent_count(recent_ratio, B))


def keydiff_scores(src, candidates):
    """score(k) = -cos(k, a), a = the mean of the candidates' unit-normalised keys."""
    d = src.keys.shape[1]
    total = np.zeros(d)
    for k in sorted(candidates):
        n = l2_norm(src.keys[k])
        for i in range(d):
            total[i] += src.keys[k, i] / n if n > 0 else 0.0
    anchor = total / len(candidates)
    a_norm = l2_norm(anchor)
    score = {}
    for k in candidates:
        den = l2_norm(src.keys[k]) * a_norm
        score[k] = -(dot_seq(src.keys[k], anchor) / den) if den > 0 else 0.0
    return score


def policy_keydiff(src, P, T, B, gqa, recent_ratio):
    """KeyDiff: evict the key most similar to the anchor of the candidates."""
    r = _recent_count(recent_ratio, B)
    if P > B:
        score = keydiff_scores(src, list(range(P)))
        cache = top_k(range(P - r), score, B - r) + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            score = keydiff_scores(src, cache + [t])
            cache.remove(lowest_ranked([k for k in cache if k <= t - r], score))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def policy_scissorhands(src, P, T, B, gqa, recent_ratio, history):
    """Scissorhands: count how many of the last `history` queries found each key important."""
    r = _recent_count(recent_ratio, B)
    important = {}  # query -> the set of keys it found important
    for q in range(max(0, P - history), P):  # full attention, n = q + 1
        row = combined_scores([{k: src.probs[g, q, k] for k in range(q + 1)}
                               for g in range(src.G)], gqa)
        important[q] = set()
        for k, v in row.items():
            _note_threshold(v, 1.0 / (q + 1), "importance")
            if v >= 1.0 / (q + 1):
                important[q].add(k)

    def counts(t):
        window = range(max(0, t - history), t)
        return {k: sum(k in important[q] for q in window) for k in range(t)}

    if P > B:
        cache = top_k(range(P - r), counts(P), B - r) + list(range(P - r, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked([k for k in cache if k <= t - r], counts(t)))
        cache.append(t)
        row = combined_scores(head_observed(src, t, cache), gqa)  # n = |C_t|
        important[t] = set()
        for k, v in row.items():
            _note_threshold(v, 1.0 / len(cache), "importance")
            if v >= 1.0 / len(cache):
                important[t].add(k)
        steps.append(list(cache))
    return prefill, steps


def output(src, weights):
    """sum_k w_k v_k over the keys of ``weights`` (a dict), in ascending position order."""
    o = np.zeros(src.values.shape[1])
    for k in sorted(weights):
        o = o + weights[k] * src.values[k]
    return o


def caote_scores(src, per_head_weights, gqa):
    """Per head: (p_k / (1 - p_k)) * ||v_k - o||, o = sum p v (+inf where p_k = 1);
    combined over the heads."""
    per_head = []
    for w in per_head_weights:
        o = output(src, w)
        s = {}
        for k, p in w.items():
            s[k] = math.inf if p >= 1.0 else (p / (1.0 - p)) * l2_norm(src.values[k] - o)
        per_head.append(s)
    return combined_scores(per_head, gqa)


def policy_caote(src, P, T, B, gqa):
    """CAOTE: evict the key whose removal changes the previous query's output least."""
    prev = {}
    if P > 0:  # the last prompt query's full attention and full output
        prev = caote_scores(src, [{k: src.probs[g, P - 1, k] for k in range(P)}
                                  for g in range(src.G)], gqa)
    cache = top_k(range(P), prev, B) if P > B else list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            cache.remove(lowest_ranked(cache, prev))
        cache.append(t)
        prev = caote_scores(src, head_observed(src, t, cache), gqa)
        steps.append(list(cache))
    return prefill, steps


def policy_snapkv_refresh(src, P, T, B, gqa, window, kernel, pooling, protect_window, refresh):
    """SnapKV on G heads (votes: per-head sums, then combined), with the pinned set re-chosen
    every `refresh` decode steps from the observed attention of the last decode queries."""
    w = min(window, P)
    n_cand = P - w if protect_window else P
    votes = combined_scores([{k: sum_seq(src.probs[g, P - w: P, k]) for k in range(n_cand)}
                             for g in range(src.G)], gqa)
    pooled = pool_votes([votes[k] for k in range(n_cand)], kernel, pooling)
    if not protect_window:
        return (top_k(range(P), pooled, B) if P > B else list(range(P))), []
    pinned = top_k(range(P - w), pooled, min(P - w, B - w))
    ring = list(range(P - w, P))  # oldest first
    prefill = sorted(pinned + ring)
    seen = {}  # decode query -> per-head observed attention over its cache
    steps = []
    for t in range(P, T):
        s = t - P
        if refresh > 0 and s > 0 and s % refresh == 0:
            cached = sorted(pinned + ring)
            queries = range(t - min(window, s), t)
            per_head = [{k: sum_seq([seen[q][g].get(k, 0.0) for q in queries]) for k in cached}
                        for g in range(src.G)]
            votes = combined_scores(per_head, gqa)
            pooled = dict(zip(cached, pool_votes([votes[k] for k in cached], kernel, pooling)))
            pinned = top_k(cached, pooled, min(len(cached), B - window))
            ring = sorted(set(cached) - set(pinned))
        if len(pinned) + len(ring) == B:
            ring.pop(0)
        ring.append(t)
        cache = pinned + ring
        seen[t] = head_observed(src, t, cache)
        steps.append(list(cache))
    return prefill, steps


def quest_pages(src, t, B, gqa, page_size):
    """Quest's selection for query t: the positions <= t of its floor(B / page_size) pages."""
    n_pages = B // page_size
    current = t // page_size
    earlier = list(range(current))
    if len(earlier) >= n_pages:
        bounds = {}
        for i in earlier:
            block = src.keys[i * page_size: (i + 1) * page_size]
            bounds[i] = (block.min(axis=0), block.max(axis=0))
        per_head = []
        for g in range(src.G):
            qs = [src.scaling[g] * float(x) for x in src.queries[g, t]]
            per_head.append({i: sum_seq([max(q * hi, q * lo) for q, lo, hi in
                                         zip(qs, bounds[i][0], bounds[i][1])]) for i in earlier})
        earlier = top_k(earlier, combined_scores(per_head, gqa), n_pages - 1)
    pages = earlier + [current]
    return [k for i in pages for k in range(i * page_size, min((i + 1) * page_size, t + 1))]


def policy_quest(src, P, T, B, gqa, page_size):
    """Quest: every key stays; query t attends to the keys of its selected pages."""
    prefill = quest_pages(src, P - 1, B, gqa, page_size) if P > 0 else []
    return prefill, [quest_pages(src, t, B, gqa, page_size) for t in range(P, T)]


@dataclass
class RefRun:
    """A reference run on a source: per-step caches and metrics of every query head."""

    caches: list  # sorted position lists C_t, t = P .. T-1
    mass: np.ndarray  # (G, T - P)
    cache_size: np.ndarray  # (T - P,) int64
    error: np.ndarray | None  # (G, T - P) relative output error, None without values
    kept: np.ndarray  # the final cache (the prefill selection without decode steps)
    near_tie: bool = False
    recall: np.ndarray | None = None  # (T - P,) share of the important keys arrived so far


def reference_run(src, policy, budget, prompt_len, gqa="mean", important=None, seed=0,
                  **params):
    """Run ``policy``'s reference (its entry in :data:`REFERENCES`) on a source, with the
    registry's defaults for the parameters not given; ``important``: optional ground-truth
    positions, for recall; ``seed``: the run's seed, for a seeded rule."""
    P, B, T = int(prompt_len), int(budget), src.T
    entry = REFERENCES[policy]
    registered = POLICIES[policy]
    prm = resolve_params(registered, params)  # the registry's defaults; unknown names raise
    for need in registered.needs:
        if getattr(src, SOURCE_FIELDS[need]) is None:
            raise ValueError(f"{policy} needs {need}; the source has none")
    if not entry.gqa and src.G != 1:
        raise ValueError(f"the reference of {policy} is single-head")
    if not 0 <= P <= T or B < registered.min_budget(prm) or registered.check(T, P, prm):
        raise ValueError(f"{policy}: a run outside the policy's domain (T={T} P={P} B={B})")
    _near_ties.clear()
    extra = {"seed": seed} if entry.seeded else {}
    if entry.one_head:
        prefill, steps = entry.rule(src.probs[0], P, T, B, **prm, **extra)
    else:
        prefill, steps = entry.rule(src, P, T, B, gqa, **prm, **extra)
    kept = np.array(sorted(steps[-1] if steps else prefill), dtype=np.int64)
    return _metrics(src, steps, kept, bool(_near_ties), important)


def _metrics(src, steps, kept, near_tie, important=None):
    P = src.T - len(steps)
    recall = None
    if important is not None:
        imp = set(int(i) for i in important)
        recall = np.array([len(imp & set(c)) / len([k for k in imp if k <= t])
                           if any(k <= t for k in imp) else np.nan
                           for t, c in zip(range(P, src.T), steps)])
    mass = np.array([[cache_mass(src.probs[g], t, c) for t, c in zip(range(P, src.T), steps)]
                     for g in range(src.G)]).reshape(src.G, len(steps))
    error = None
    if src.values is not None:
        error = np.zeros((src.G, len(steps)))
        for i, (t, c) in enumerate(zip(range(P, src.T), steps)):
            for g, w in enumerate(head_observed(src, t, c)):
                full = output(src, {k: src.probs[g, t, k] for k in range(t + 1)})
                norm = l2_norm(full)
                error[g, i] = l2_norm(output(src, w) - full) / norm if norm > 0 else 0.0
    return RefRun([sorted(c) for c in steps], mass, np.array([len(c) for c in steps], np.int64),
                  error, kept, near_tie, recall)


# ---------------------------------------------------------------- protocols
# A protocol changes when a policy compresses and with which queries (interval,
# target_ratio, question_len with compress). A rule below is its per-step policy seen as
# (prefill scores, protected positions, current scores, what a query teaches it).


class _Rule:
    """One policy's ranking under a protocol: ``score`` of cached keys now (a dict),
    ``protected(k, t)`` (never evicted at step t), ``learn(t, cache)`` after query t."""

    def __init__(self, policy, p, P0, T, B, params):
        self.policy, self.p = policy, p
        self.recent = _recent_count(params.get("recent_ratio", 0.0), B)
        self.sinks = params.get("sinks", 0)
        if policy == "h2o":
            self.score = {k: s for k, s in enumerate(prompt_colsum(p, P0))}
        elif policy == "h2o_offline":
            self.score = {k: sum_seq(p[k:T, k]) for k in range(T)}
        elif policy == "knorm":  # a static score given with the parameters: -||k||
            self.score = dict(enumerate(params["_static"]))
        elif policy == "tova":
            self.recent = 0
            self.score = {k: p[P0 - 1, k] for k in range(P0)} if P0 else {}
        else:  # window, streaming_llm: by position (the oldest ranks lowest)
            self.recent = 0
            self.score = {k: float(k) for k in range(T)}

    def prefill(self, P0, B):
        """The prefill selection of the prompt ``0 .. P0-1`` at budget B."""
        if P0 <= B:
            return list(range(P0))
        if self.policy in ("window", "streaming_llm"):
            return list(range(min(self.sinks, P0))) + list(range(P0 - (B - self.sinks), P0))
        r = self.recent
        return top_k(range(P0 - r), self.score, B - r) + list(range(P0 - r, P0))

    def protected(self, k, t):
        return k > t - self.recent or k < self.sinks

    def joins(self, t):
        if self.policy in ("h2o", "tova"):
            self.score[t] = 0.0

    def learn(self, t, cache):
        if self.policy == "h2o":
            for k, v in observed(self.p, t, cache).items():
                self.score[k] += v
        elif self.policy == "tova":
            self.score = observed(self.p, t, cache)


def compress_to(rule, cache, m, t):
    """Keep the m best-ranked keys of ``cache`` at step t (before t joins), ranked once:
    the protected ones always, then the top of the others by the total order."""
    if len(cache) <= m:
        return list(cache)
    keep = [k for k in cache if rule.protected(k, t)]
    others = [k for k in cache if not rule.protected(k, t)]
    assert len(keep) <= m, "protected keys alone exceed the target"
    return sorted(keep + top_k(others, rule.score, m - len(keep)))


def _join(rule, cache, t, steps):
    """Key ``t`` joins ``cache``; the step's cache is recorded; query ``t`` teaches the rule."""
    cache.append(t)
    rule.joins(t)
    steps.append(list(cache))
    rule.learn(t, cache)


def protocol_caches(p, policy, P, T, B, params, rule=None):
    """(prefill selection, [C_t for t = P .. T-1]) of ``policy`` under the protocol of
    ``params`` (``interval``, ``target_ratio``, ``question_len``, ``compress``); ``rule``:
    a ranking other than the policy's own on ``p`` (a layer's, :class:`LayerRule`)."""
    N = params.get("interval", 1)
    ratio = params.get("target_ratio", 1.0)
    Q = params.get("question_len", 0) if params.get("compress") == "before_question" else 0
    P0 = P - Q  # the prompt the prefill sees
    rule = rule or _Rule(policy, p, P0, T, B, params)
    cache = rule.prefill(P0, B)
    prefill = list(cache)
    for t in range(P0, P):  # the question joins without eviction; the policy learns
        cache.append(t)
        rule.joins(t)
        rule.learn(t, cache)
    Bd = B + Q  # the decode budget
    steps = []
    for t in range(P, T):
        if ratio != 1.0:
            if (t - P + 1) % N == 0:
                cache = compress_to(rule, cache, max(1, math.floor(ratio * (t + 1))) - 1, t)
        elif len(cache) + 1 > Bd + N - 1:
            cache = compress_to(rule, cache, Bd - 1, t)
        _join(rule, cache, t, steps)
    return prefill, steps


def _page_score(rule, cache, j, S, reduce):
    """A page's score: its cached keys' scores, summed in position order and divided by S
    (mean), or their max."""
    values = [rule.score[k] for k in sorted(cache) if k // S == j]
    return max(values) if reduce == "max" else sum_seq(values) / S


def paged_caches(p, policy, P, T, B, params, rule=None):
    """(prefill selection, [C_t]) under ``page = S``: at most floor(B / S) pages held (the
    receiving page included); a key opening a page at the cap evicts the lowest-ranked
    complete unprotected page (lowest score, then highest page index) first."""
    S, reduce = params["page"], params.get("page_reduce", "mean")
    cap = B // S
    rule = rule or _Rule(policy, p, P, T, B, params)
    pages = sorted({k // S for k in range(P)})
    guarded = {j for j in pages if any(k >= P - rule.recent or k < rule.sinks
                                       for k in range(j * S, min(j * S + S, P)))}
    if P % S:
        guarded.add((P - 1) // S)
    assert len(guarded) <= cap, "protected pages exceed the cap"
    others = sorted((j for j in pages if j not in guarded),
                    key=lambda j: (-_page_score(rule, range(P), j, S, reduce), j))
    kept_pages = guarded | set(others[:cap - len(guarded)])
    cache = [k for k in range(P) if k // S in kept_pages]
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        held = sorted({k // S for k in cache})
        if t % S == 0 and len(held) >= cap:
            free = [j for j in held if not any(rule.protected(k, t) for k in cache if k // S == j)]
            assert free, "protected pages exceed the cap"
            worst = min(free, key=lambda j: (_page_score(rule, cache, j, S, reduce), -j))
            cache = [k for k in cache if k // S != worst]
        _join(rule, cache, t, steps)
    return prefill, steps


class LayerRule(_Rule):
    """``heads = "uniform"``: the rules of a layer's KV heads (one query head each, all
    over the one cache), ranked by the sum of their scores in KV-head order."""

    def __init__(self, rules):
        self.rules, self.policy = rules, rules[0].policy
        self.recent, self.sinks = rules[0].recent, rules[0].sinks

    @property
    def score(self):
        return {k: sum_seq([r.score[k] for r in self.rules]) for k in self.rules[0].score}

    def joins(self, t):
        for r in self.rules:
            r.joins(t)

    def learn(self, t, cache):
        for r in self.rules:
            r.learn(t, cache)


def uniform_caches(ps, policy, P, T, B, params):
    """(prefill selection, [C_t]) of ``policy`` with ``heads = "uniform"`` on a layer whose
    KV heads have the (T, T) attention ``ps`` (per step, or in pages of ``page``)."""
    rule = LayerRule([_Rule(policy, p, P, T, B, params) for p in ps])
    if params.get("page", 1) != 1:
        return paged_caches(ps[0], policy, P, T, B, params, rule)
    return protocol_caches(ps[0], policy, P, T, B, params, rule)


def filtering_caches(ps, policy, P, T, B, params):
    """(prefill selection, [C_t]) of KV head 0 of a layer whose KV heads have the (T, T)
    attention ``ps`` (one query head each) under ``filtering`` (kvpress PR 258): each KV
    head's own prefill at B; key t joins, query t attends and teaches the rules, then key t
    stays iff its score is >= the n_kept-th highest of the cache (ties keep it): per head
    (FilteringPress, n_kept = int((t + 1) * (1 - r))) or by the majority of the KV heads
    (UniformFilteringPress, n_kept = int(n * (1 - r))), at least 1 (kvpress PR 258 at
    48cc0e2)."""
    r, majority = params["filter_ratio"], params["filtering"] == "majority"
    rules = [_Rule(policy, p, P, T, B, params) for p in (ps if majority else ps[:1])]
    caches = [rule.prefill(P, B) for rule in rules]
    prefill = list(caches[0])
    steps = []
    for t in range(P, T):
        votes = []
        for rule, cache in zip(rules, caches):
            cache.append(t)
            rule.joins(t)
            rule.learn(t, cache)
            n = len(cache)
            if majority:
                n_kept = max(1, int(n * (1 - r)))
            else:
                n_kept = max(1, int((t + 1) * (1 - r)))
            scores = sorted((rule.score[k] for k in cache), reverse=True)
            votes.append(n_kept >= n or rule.score[t] >= scores[n_kept - 1])
        if 2 * sum(votes) < len(votes):
            for cache in caches:
                cache.remove(t)
        steps.append(list(caches[0]) + ([] if t in caches[0] else [t]))
    return prefill, steps


def threshold_caches(p, policy, P, T, params):
    """(prefill selection, [C_t]) under ``threshold = tau``: the ``w`` newest keys held; key
    ``t - w`` (at the prefill, every key before ``P - w``) stays iff its score >= tau."""
    tau, w = params["threshold"], params.get("threshold_window", 128)
    rule = _Rule(policy, p, P, T, P, params)
    cache = [k for k in range(P) if k >= P - w or rule.score[k] >= tau]
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        k = t - w
        if k >= 0 and k in cache and not rule.score[k] >= tau:
            cache.remove(k)
        _join(rule, cache, t, steps)
    return prefill, steps


# ================================================================ rkv, dropkv, chunkkv
# Rules from their authors' code (R-KV r1_kv.py at d15c976; kvpress PR 285 revision 1;
# kvpress ChunkKVPress at 8bb29b9), written from the rule, on sources.


def softmax_seq(x):
    """exp(x - max) / sum, the sum in order."""
    top = max(x)
    e = [math.exp(v - top) for v in x]
    total = sum_seq(e)
    return [v / total for v in e]


def rkv_scores(src, candidates, window, kernel, mix_lambda):
    """R-KV's score of each non-window candidate (the window: the `window` newest)."""
    cand = sorted(candidates)
    n = len(cand)
    old, recent = cand[:n - window], cand[n - window:]
    votes = [0.0] * len(old)
    for q in recent:  # the window's queries: the group's max logit, softmax over `old`
        logits = [max(src.scaling[g] * dot_seq(src.queries[g, q], src.keys[k])
                      for g in range(src.G)) for k in old]
        for j, p in enumerate(softmax_seq(logits)):
            votes[j] += p
    attention = pool_votes([v / window for v in votes], kernel, "max")
    unit = {k: [x / (l2_norm(src.keys[k]) + 1e-8) for x in src.keys[k]] for k in cand}
    cos = [[0.0 if i == j else dot_seq(unit[a], unit[b]) for j, b in enumerate(cand)]
           for i, a in enumerate(cand)]
    for row in cos:  # the last key above 0.5 in each row is masked (the first if none)
        above = [j for j in range(n) if row[j] > 0.5]
        row[above[-1] if above else 0] = 0.0
    redundancy = softmax_seq([sum_seq([cos[i][j] for i in range(n)]) / n for j in range(n)])
    return {k: attention[j] * mix_lambda - redundancy[j] * (1.0 - mix_lambda)
            for j, k in enumerate(old)}


def policy_rkv(src, P, T, B, gqa, window, kernel, mix_lambda):
    """R-KV: the window newest + the best lam * attention - (1 - lam) * redundancy; at each
    decode step over budget, the lowest non-window candidate of the cache plus t leaves."""
    if P > B:
        score = rkv_scores(src, range(P), window, kernel, mix_lambda)
        cache = top_k(range(P - window), score, B - window) + list(range(P - window, P))
    else:
        cache = list(range(P))
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            candidates = sorted(cache + [t])
            score = rkv_scores(src, candidates, window, kernel, mix_lambda)
            cache.remove(lowest_ranked(candidates[:len(candidates) - window], score))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def rkv_protocol_caches(src, P, T, B, params):
    """(prefill, [C_t]) of R-KV under ``interval`` (with ``target_ratio``): a compression
    before t joins ranks the cache plus t once, as the code compresses its buffer, with
    the queries of the newest ``window`` of them; the window's keys stay and the best
    others fill the target."""
    window, kernel, lam = params["window"], params["kernel"], params["mix_lambda"]
    N, ratio = params.get("interval", 1), params.get("target_ratio", 1.0)
    prefill, _ = policy_rkv(src, P, P, B, "mean", window, kernel, lam)
    cache, steps = list(prefill), []
    for t in range(P, T):
        if ratio != 1.0:
            m = max(1, math.floor(ratio * (t + 1))) - 1 if (t - P + 1) % N == 0 else len(cache)
        else:
            m = B - 1 if len(cache) + 1 > B + N - 1 else len(cache)
        if len(cache) > m:
            candidates = sorted(cache + [t])
            score = rkv_scores(src, candidates, window, kernel, lam)
            old = candidates[:len(candidates) - window]
            stay = [k for k in cache if k not in score]
            cache = sorted(stay + top_k(old, score, m - len(stay)))
        cache.append(t)
        steps.append(list(cache))
    return prefill, steps


def dropkv_scores(src, P, gqa, window, kernel):
    """DropKV's pooled score of every prompt position: over the window's queries i, the
    squared output change of dropping j, (p_ij / (1 - p_ij + 1e-6))^2 ||v_j - o_i||^2."""
    per_head = []
    for g in range(src.G):
        score = {j: 0.0 for j in range(P)}
        for i in range(P - min(window, P), P):
            row = {j: src.probs[g, i, j] for j in range(i + 1)}
            o = output(src, row)
            for j in range(P):
                p = row.get(j, 0.0)
                weight = p / (1.0 - p + 1e-6)
                diff = src.values[j] - o
                score[j] += weight * weight * dot_seq(diff, diff)
        per_head.append(score)
    combined = combined_scores(per_head, gqa)
    return pool_votes([combined[j] for j in range(P)], kernel, "avg")


def pinned_ring(P, T, B, w, pinned):
    """Pinned prompt keys + a ring over the other slots (the window first, oldest first)."""
    ring = list(range(P - w, P))
    prefill = sorted(pinned + ring)
    steps = []
    for t in range(P, T):
        if len(pinned) + len(ring) == B:
            ring.pop(0)
        ring.append(t)
        steps.append(pinned + ring)
    return prefill, steps


def policy_dropkv(src, P, T, B, gqa, window, kernel):
    """DropKV: pin the top B - w prefix keys by the pooled drop score; ring for the rest."""
    w = min(window, P)
    if P <= B:
        return pinned_ring(P, T, B, w, list(range(P - w)))
    score = dropkv_scores(src, P, gqa, window, kernel)
    return pinned_ring(P, T, B, w, top_k(range(P - w), score, B - w))


def snapkv_prefix_scores(src, P, gqa, window, kernel, pooling):
    """SnapKV's pooled votes of the prefix keys (older than the window)."""
    w = min(window, P)
    votes = combined_scores([{k: sum_seq(src.probs[g, P - w:P, k]) for k in range(P - w)}
                             for g in range(src.G)], gqa)
    return pool_votes([votes[k] for k in range(P - w)], kernel, pooling)


def policy_chunkkv(src, P, T, B, gqa, window, kernel, pooling, chunk, layer=None):
    """ChunkKV: SnapKV's scores summed over the layer's KV heads (``layer``: their sources
    in order, default this one alone), chunks of the prefix ranked by their mean score, the
    top floor((B - w) / chunk) pinned; ring for the rest."""
    w = min(window, P)
    prefix = P - w
    if P <= B:
        return pinned_ring(P, T, B, w, list(range(prefix)))
    per_kv = [snapkv_prefix_scores(s, P, gqa, window, kernel, pooling) for s in layer or [src]]
    summed = [sum_seq([scores[k] for scores in per_kv]) for k in range(prefix)]
    chunks = [list(range(lo, min(prefix, lo + chunk))) for lo in range(0, prefix, chunk)]
    score = [sum_seq([summed[k] for k in c]) / len(c) for c in chunks]
    chosen = top_k(range(len(chunks)), score, (B - w) // chunk)
    return pinned_ring(P, T, B, w, [k for c in chosen for k in chunks[c]])




# ================================================================ expected_attention
# kvpress ExpectedAttentionPress (commit 8bb29b9): the expected softmax weight of a key
# under the distribution of a future query, times ||v||; sinks always kept.
@dataclass
class RopeSource(Source):
    """A source with the queries before RoPE (G, T, d) and the RoPE that rotated them:
    inverse frequencies (n,) on the first 2n dimensions (i pairs with i + n) and the factor
    on cos and sin."""

    pre_rope_queries: np.ndarray | None = None
    rope_freq: np.ndarray | None = None
    rope_scale: float = 1.0


def rope_matrix(freq, scale, d, t):
    """The (d, d) RoPE matrix of position t (rotate-half pairs, scaled cos and sin)."""
    R = np.eye(d)
    n = len(freq)
    for i in range(n):
        angle = t * float(freq[i])
        c, s = scale * math.cos(angle), scale * math.sin(angle)
        R[i, i], R[i + n, i + n], R[i, i + n], R[i + n, i] = c, c, -s, s
    return R


def future_query_moments(src, g, positions, start, n_future, covariance):
    """Mean and covariance (divided by their count) of head g's pre-RoPE queries at
    ``positions``, carried by the mean RoPE matrix of positions start .. start+n_future-1."""
    q = [np.asarray(src.pre_rope_queries[g, t], dtype=np.float64) for t in positions]
    d = q[0].shape[0]
    mu = sum(q) / len(q)
    cov = np.zeros((d, d))
    if covariance:
        cov = sum(np.outer(x - mu, x - mu) for x in q) / len(q)
    R = sum(rope_matrix(src.rope_freq, src.rope_scale, d, t)
            for t in range(start, start + n_future)) / n_future
    return R @ mu, R @ cov @ R.T


def expected_logit(mu, cov, key):
    """z = mu . k / sqrt(d) + k^T cov k / (2 d)."""
    k = np.asarray(key, dtype=np.float64)
    d = k.shape[0]
    return dot_seq(mu, k) / math.sqrt(d) + dot_seq(k, cov @ k) / d / 2


def expected_attention_scores(src, queries, keys, norm_keys, start, gqa, n_sink, n_future,
                              covariance, vnorm):
    """Score of each position in ``keys``: per head exp(z) normalised over ``norm_keys``
    (the softmax), combined over the heads, times ||v||; statistics from ``queries``."""
    per_head = []
    for g in range(src.G):
        mu, cov = future_query_moments(src, g, queries, start, n_future, covariance)
        z = {j: expected_logit(mu, cov, src.keys[j]) for j in set(keys) | set(norm_keys)}
        top = max(z[j] for j in norm_keys)
        total = sum(math.exp(z[j] - top) for j in norm_keys)
        per_head.append({j: math.exp(z[j] - top) / total for j in keys})
    combined = combined_scores(per_head, gqa)
    return {j: combined[j] * (l2_norm(src.values[j]) if vnorm else 1.0) for j in keys}


def policy_expected_attention(src, P, T, B, gqa, n_sink, n_future, covariance, vnorm):
    """Static scores from the prompt's statistics (queries n_sink .. P-1, future positions
    from P, softmax normaliser of the prompt keys after the sinks); sinks score +inf; keep
    the top B at prefill, evict the lowest score at decode."""
    if P <= n_sink and P < T:
        raise ValueError("expected_attention needs a prompt query after the sinks")
    score = [math.inf] * T
    if P > n_sink:
        rest = list(range(n_sink, T))
        found = expected_attention_scores(src, range(n_sink, P), rest, range(n_sink, P), P, gqa,
                                          n_sink, n_future, covariance, vnorm)
        for j in rest:
            score[j] = found[j]
    return _static_keep(score, P, T, B, 0)





# ---------------------------------------------------------------- cake (CAKE, cakekv c4675ce)
CAKE_POOL = 5


def cake_pool(values):
    """Average pool of width 5 with zero padding, divided by 5 (avg_pool1d, padding 2)."""
    m = len(values)
    return [sum_seq(values[max(0, i - 2): min(m, i + 3)]) / CAKE_POOL for i in range(m)]


def cake_rating(column, gamma):
    """mean + gamma * unbiased variance of one key's attention over the window's queries."""
    w = len(column)
    mean = sum_seq(column) / w
    var = sum_seq([(x - mean) ** 2 for x in column]) / (w - 1)
    return mean + gamma * var


def _note_band(inside, outside, what):
    """A near tie if a kept and an evicted key score within rounding, even exactly equal:
    a pooled score is a sum of five numbers, and keys whose sums are equal in exact
    arithmetic may differ in the last bit in one implementation and not in another."""
    if inside and outside:
        a, b = min(inside), max(outside)
        if abs(a - b) <= NEAR_TIE_RTOL * max(abs(a), abs(b)):
            _near_ties.append((what, a, b))


def policy_cake(src, P, T, B, gqa, window, gamma):
    """CAKE's indicator: prefill keeps the window + the top B - window prefix keys by the
    pooled window rating; decode evicts the lowest pooled observed attention of the
    previous query among the keys outside the newest `window` (the incoming one included)."""
    if P <= B:
        cache = list(range(P))
    else:
        n = P - window
        per_head = []
        for g in range(src.G):
            ratings = [cake_rating(src.probs[g, n:P, k], gamma) for k in range(n)]
            per_head.append(dict(enumerate(cake_pool(ratings))))
        score = combined_scores(per_head, gqa)
        cache = top_k(range(n), score, B - window) + list(range(n, P))
        kept = set(cache)
        _note_band([v for k, v in score.items() if k in kept],
                   [v for k, v in score.items() if k not in kept], "cake prefill")
    prefill = list(cache)
    prev = [{k: src.probs[g, P - 1, k] for k in cache} for g in range(src.G)] if P else []
    steps = []
    for t in range(P, T):
        if len(cache) == B:
            candidates = sorted(cache)[:B + 1 - window]
            per_head = [dict(zip(candidates, cake_pool([prev[g][k] for k in candidates])))
                        for g in range(src.G)]
            score = combined_scores(per_head, gqa)
            evicted = lowest_ranked(candidates, score)
            _note_band([v for k, v in score.items() if k != evicted], [score[evicted]],
                       "cake evict")
            cache.remove(evicted)
        cache.append(t)
        prev = head_observed(src, t, cache)
        steps.append(list(cache))
    return prefill, steps




# ---------------------------------------------------------------- KIVI storage (876b4d2)
def kivi_dequantise_group(xs, bits):
    """One group through KIVI: codes round_half_even(clip((x - lo) / s, 0, 2^b - 1)),
    s = (hi - lo) / (2^b - 1), read back as code * s + lo (a constant group reads lo)."""
    levels = 2.0 ** bits - 1.0
    lo, hi = min(xs), max(xs)
    s = (hi - lo) / levels
    if s == 0.0:
        return [lo for _ in xs]
    return [round(min(max((x - lo) / s, 0.0), levels)) * s + lo for x in xs]  # round: half-even


def kivi_cache(keys, values, bits, group, residual):
    """The cache's keys (n, d) and values (n, dv), in position order, as KIVI stores them:
    keys of the first residual * floor((n-1) / residual) tokens per channel in groups of
    `group` tokens; values of the first n - 1 - residual tokens per token in groups of
    `group` channels; the others exact."""
    keys = np.array(keys, dtype=np.float64)
    values = np.array(values, dtype=np.float64)
    n = keys.shape[0]
    n_keys = residual * ((n - 1) // residual) if n > 0 else 0
    n_values = max(n - 1 - residual, 0)
    for start in range(0, n_keys, group):
        for i in range(keys.shape[1]):
            keys[start:start + group, i] = kivi_dequantise_group(
                [float(x) for x in keys[start:start + group, i]], bits)
    for j in range(n_values):
        for start in range(0, values.shape[1], group):
            values[j, start:start + group] = kivi_dequantise_group(
                [float(x) for x in values[j, start:start + group]], bits)
    return keys, values


def kivi_metrics(src, P, caches, bits, group, residual):
    """(mass, error), each (G, steps), of attention over the KIVI cache at each step:
    p~ = softmax over the cache of scaling * q . k~, o~ = sum p~ v~; mass = exp(-KL(p~ || p))
    with p the full attention of the exact keys; error = |o~ - o| / |o|."""
    mass = np.zeros((src.G, len(caches)))
    error = np.zeros((src.G, len(caches)))
    for s, cache in enumerate(caches):
        t = P + s
        cache = sorted(cache)
        kq, vq = kivi_cache(src.keys[cache], src.values[cache], bits, group, residual)
        for g in range(src.G):
            q = src.queries[g, t]
            quantised = [src.scaling[g] * dot_seq(q, k) for k in kq]
            full = [src.scaling[g] * dot_seq(q, src.keys[k]) for k in range(t + 1)]
            log_z = max(quantised) + math.log(sum_seq([math.exp(x - max(quantised))
                                                        for x in quantised]))
            log_full_z = max(full) + math.log(sum_seq([math.exp(x - max(full)) for x in full]))
            kl = 0.0
            o = np.zeros(vq.shape[1])
            for j, k in enumerate(cache):
                log_w = quantised[j] - log_z
                kl += math.exp(log_w) * (log_w - (full[k] - log_full_z))
                o = o + math.exp(log_w) * vq[j]
            mass[g, s] = math.exp(-kl)
            exact = output(src, {k: src.probs[g, t, k] for k in range(t + 1)})
            norm = l2_norm(exact)
            error[g, s] = l2_norm(o - exact) / norm if norm > 0 else 0.0
    return mass, error


# ================================================================ openvino
# OpenVINO GenAI's CacheEvictionAlgorithm (openvino.genai da1db86, cache_eviction.cpp):
# start | evictable middle | recent, whole blocks, one decision for the layer's KV heads.
def forward_max_pool(values, width):
    """out[i] = max(values[i .. i + width - 1]), clipped at the end (the code's _max_pool)."""
    return [max(values[i:i + width]) for i in range(len(values))]


def layer_prompt_row(sources, P, snapkv_window):
    """The layer's prefill scores of keys 0 .. P-1: each query head's attention summed over
    the last ``snapkv_window`` prompt queries (0: all), then over the KV head's query
    heads, then over the KV heads."""
    lo = P - min(snapkv_window, P) if snapkv_window else 0
    return [sum_seq([sum_seq([sum_seq(s.probs[g, lo:P, k]) for g in range(s.G)])
                     for s in sources]) for k in range(P)]


def layer_row(sources, t, cache):
    """Query t's observed attention over the cache, summed over each KV head's query heads,
    then over the layer's KV heads (a dict by key)."""
    per_kv = [head_observed(s, t, cache) for s in sources]
    return {k: sum_seq([sum_seq([obs[k] for obs in heads]) for heads in per_kv]) for k in cache}


def policy_openvino(src, P, T, B, gqa, mode, block, start_blocks, recent_blocks, snapkv_window,
                    pool, layer=None):
    """OpenVINO's block eviction over a layer (``layer``: its KV heads' sources in order,
    default this one alone). Scores of the keys past the start area: the layer's attention
    (observed rows summed over each KV head's query heads, then over the KV heads), pooled
    forward over cached neighbours, accumulated (norm_sum: divided by the registered queries
    that saw the key). Before key t joins, if the cache with it exceeds A + S - 1, the
    lowest-scoring blocks of the middle go (ties: the lower block), leaving A - start -
    recent tokens of middle; ``gqa`` does not apply (the code sums the heads)."""
    sources = layer or [src]
    S, start, recent = block, block * start_blocks, block * recent_blocks
    A = S * ((B + 1) // S) - S
    acc, seen = {}, {}
    cache = list(range(P))
    if P > start:
        lo = P - min(snapkv_window, P) if snapkv_window else 0
        row = layer_prompt_row(sources, P, snapkv_window)
        tracked = list(range(start, P))
        seen_by = P if snapkv_window == 0 else min(snapkv_window, P)
        for k, v in zip(tracked, forward_max_pool([row[k] for k in tracked], pool)):
            acc[k], seen[k] = v, min(P - k, seen_by)

    def evict(n):
        """Free the lowest blocks of the middle when n keys (the incoming one counted)
        exceed the arena."""
        if n <= A + S - 1:
            return
        blocks = [cache[start + i * S:start + (i + 1) * S]
                  for i in range(n // S - recent // S - start // S)]
        count = len(blocks) - (A - start - recent) // S
        score = []
        for b in blocks:
            total = 0.0
            for k in b:
                total += acc[k] / seen[k] if mode == "norm_sum" else acc[k]
            score.append(total)
        order = sorted(range(len(blocks)), key=lambda i: (score[i], i))
        # equal sums in exact arithmetic may differ in the last bit in one implementation
        _note_band([score[i] for i in order[count:]], [score[i] for i in order[:count]], "evict")
        for i in order[:count]:
            for k in blocks[i]:
                cache.remove(k)
                del acc[k], seen[k]

    evict(P)
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        evict(len(cache) + 1)
        cache.append(t)
        steps.append(list(cache))
        if len(cache) > start:
            row = layer_row(sources, t, cache)
            tracked = cache[start:]
            for k, v in zip(tracked, forward_max_pool([row[k] for k in tracked], pool)):
                acc[k], seen[k] = acc.get(k, 0.0) + v, seen.get(k, 0) + 1
    return prefill, steps


def arkv_block_diversity(key_sets, S):
    """OpenVINO core's ``AdaptiveRKVDiversityCalculator`` on an evictable area: ``key_sets``
    one list of n key vectors per KV head. Each key over sqrt(|k|^2 + eps) (float32's eps);
    per head the cosine similarities with the diagonal zeroed, each value below its row's
    mean (over all n, the zero included) zeroed; the mean over heads; per block of S rows,
    minus the sum of its rows: an (n / S) x n list."""
    eps = float(np.finfo(np.float32).eps)
    n = len(key_sets[0])
    total = [[0.0] * n for _ in range(n)]
    for keys in key_sets:
        unit = []
        for k in keys:
            norm = math.sqrt(sum_seq([float(x) * float(x) for x in k]) + eps)
            unit.append([float(x) / norm for x in k])
        for i in range(n):
            sim = [0.0 if i == j else sum_seq([a * b for a, b in zip(unit[i], unit[j])])
                   for j in range(n)]
            mean = sum_seq(sim) / n
            for j in range(n):
                _note_threshold(sim[j], mean, "arkv row mean")
                total[i][j] += sim[j] if sim[j] >= mean else 0.0
    out = [[0.0] * n for _ in range(n // S)]
    for b in range(n // S):
        for j in range(n):
            for i in range(b * S, b * S + S):
                out[b][j] -= total[i][j] / len(key_sets)
    return out


def arkv_split(score, capacity, attention_mass):
    """``get_diversity_block_set``: pop the highest-scoring blocks (the lower first among
    equals) while their sum is below attention_mass of the total and fewer than
    ``capacity`` are kept; the rest (ascending) and the count kept."""
    order = sorted(range(len(score)), key=lambda i: (-score[i], i))
    expected, total, kept = sum_seq(score) * attention_mass, 0.0, 0
    while kept < len(order) and kept < capacity:
        _note_threshold(total, expected, "arkv attention mass")
        if not total < expected:
            break
        total += score[order[kept]]
        kept += 1
    return sorted(order[kept:]), kept


def arkv_most_diverse(diversity, candidates, count, S):
    """``get_filtered_block_diversity`` and ``get_most_diverse_blocks``: each candidate's
    diversity row summed over the candidates' keys (block by block, in order), over their
    number; the ``count`` highest (the lower block first among equals)."""
    value = {}
    for b in candidates:
        acc = 0.0
        for c in candidates:
            acc += sum_seq(diversity[b][c * S:c * S + S])
        value[b] = acc / (len(candidates) * S)
    order = sorted(candidates, key=lambda b: (-value[b], b))
    _note_band([value[b] for b in order[:count]], [value[b] for b in order[count:]],
               "arkv diversity")
    return set(order[:count])


def policy_openvino_arkv(src, P, T, B, gqa, attention_mass, window_size, block, start_blocks,
                         recent_blocks, snapkv_window, pool, layer=None):
    """OpenVINO's block eviction, ADAPTIVE_RKV mode, over a layer (``layer`` as in
    :func:`policy_openvino`). Scores of the keys past the start area: the first registration
    (the prefill's SnapKV sum, or the first decode row) as is; then the mean of the last
    ``window_size`` registrations since the last eviction (missing keys count 0), pooled
    forward. Before key t joins, if the cache with it exceeds A + S - 1: keep the
    highest-scoring middle blocks up to attention_mass of their total (at most A - start -
    recent tokens), fill the rest of that with the most diverse of the other blocks, evict
    the others; ``gqa`` does not apply."""
    sources = layer or [src]
    S, start, recent = block, block * start_blocks, block * recent_blocks
    A = S * ((B + 1) // S) - S
    stay = (A - start - recent) // S
    acc, queue = {}, []
    cache = list(range(P))

    def register(row, tracked):
        nonlocal acc
        entry = dict(zip(tracked, row))
        if not acc:
            acc, queue[:] = entry, [entry]
            return
        if len(queue) >= window_size:
            queue.pop(0)
        queue.append(entry)
        mean = [sum_seq([e.get(k, 0.0) for e in queue]) / len(queue) for k in tracked]
        acc = dict(zip(tracked, forward_max_pool(mean, pool)))

    if P > start:
        row = layer_prompt_row(sources, P, snapkv_window)
        register(row[start:], list(range(start, P)))

    def evict(n):
        if n <= A + S - 1:
            return
        blocks = [cache[start + i * S:start + (i + 1) * S]
                  for i in range(n // S - recent // S - start // S)]
        candidates, kept = arkv_split([sum_seq([acc[k] for k in b]) for b in blocks], stay,
                                      attention_mass)
        if stay > kept:
            area = [k for b in blocks for k in b]
            diversity = arkv_block_diversity([[s.keys[k] for k in area] for s in sources], S)
            chosen = arkv_most_diverse(diversity, candidates, stay - kept, S)
            candidates = [b for b in candidates if b not in chosen]
        for i in candidates:
            for k in blocks[i]:
                cache.remove(k)
                del acc[k]
        queue.clear()

    evict(P)
    prefill = list(cache)
    steps = []
    for t in range(P, T):
        evict(len(cache) + 1)
        cache.append(t)
        steps.append(list(cache))
        if len(cache) > start:
            row = layer_row(sources, t, cache)
            register([row[k] for k in cache[start:]], cache[start:])
    return prefill, steps


# ================================================================ the table of policy cases
SOURCE_FIELDS = {"keys": "keys", "values": "values", "queries": "queries",
                 "rope": "pre_rope_queries"}
"""The source's field holding what a policy needs (``Policy.needs``)."""


@dataclass(frozen=True)
class Reference:
    """One policy's reference and its test cases.

    ``rule(src, P, T, B, gqa, **params)`` runs on a source (one KV head and its query
    heads); with ``one_head``, ``rule(p, P, T, B, **params)`` on query head 0's (T, T)
    probabilities. It returns (the prefill selection, [C_t for t = P .. T-1]) and takes the
    registry's parameters by name (plus ``seed=`` if ``seeded``). ``variants``: parameter
    sets the tests run besides the defaults (each where the policy takes the prompt
    length). ``gqa``: the rule holds on groups of several query heads (else the tests give
    it one). ``small``: parameters fitting the budgets from 5 of the registry-wide tests
    (a policy below its minimum budget is an error)."""

    rule: Callable
    variants: tuple[dict, ...] = ()
    gqa: bool = True
    small: dict = field(default_factory=dict)
    one_head: bool = False
    seeded: bool = False


SNAPKV_VARIANTS = (
    {"window": 4, "kernel": 3}, {"window": 3, "kernel": 5, "pooling": "avg"},
    {"window": 2, "kernel": 1, "pooling": "none"}, {"window": 6, "kernel": 7, "pooling": "avg"},
    {"window": 1, "kernel": 9, "pooling": "max"}, {"window": 5, "kernel": 3, "pooling": "none"},
    {"window": 3, "kernel": 3}, {"window": 1, "pooling": "avg"},
    {"window": 3, "kernel": 3, "refresh": 2},
    {"window": 2, "kernel": 5, "pooling": "avg", "refresh": 1},
    {"window": 4, "kernel": 1, "pooling": "none", "refresh": 3},
    {"window": 1, "kernel": 3, "pooling": "max", "refresh": 5},
    # protect_window=False: the prompt is the whole sequence (no decode steps)
    {"window": 32, "kernel": 7, "pooling": "none", "protect_window": False},
    {"window": 4, "kernel": 3, "pooling": "max", "protect_window": False},
    {"window": 3, "kernel": 5, "pooling": "avg", "protect_window": False},
    {"window": 1, "kernel": 1, "pooling": "avg", "protect_window": False},
)

REFERENCES = {
    "full": Reference(policy_full, one_head=True),
    "window": Reference(policy_window, one_head=True),
    "streaming_llm": Reference(policy_streaming_llm, ({"sinks": 2}, {"sinks": 1}, {"sinks": 0}),
                               one_head=True),
    "h2o": Reference(policy_h2o, (
        {"recent_ratio": 0.0}, {"recent_ratio": 0.25, "normalize": True}, {"normalize": True},
        {"accumulate": "full"}, {"recent_ratio": 0.75, "normalize": True, "accumulate": "full"},
        {"recent_ratio": 0.0, "accumulate": "full"}), gqa=False, one_head=True),
    "h2o_offline": Reference(policy_h2o_offline, ({"recent_ratio": 0.0}, {"recent_ratio": 0.3}),
                             gqa=False, one_head=True),
    "snapkv": Reference(policy_snapkv_refresh, SNAPKV_VARIANTS, small={"window": 4}),
    "tova": Reference(policy_tova, gqa=False, one_head=True),
    "random": Reference(policy_random, gqa=False, one_head=True, seeded=True),
    "oracle": Reference(policy_oracle, gqa=False, one_head=True),
    "knorm": Reference(policy_knorm, ({"recent_ratio": 0.3},)),
    "keydiff": Reference(policy_keydiff, ({"recent_ratio": 0.5},)),
    "scissorhands": Reference(policy_scissorhands,
                              ({"history": 4}, {"history": 1, "recent_ratio": 0.0})),
    "caote": Reference(policy_caote),
    "quest": Reference(policy_quest, ({"page_size": 4}, {"page_size": 1}, {"page_size": 3}),
                       small={"page_size": 4}),
    "rkv": Reference(policy_rkv, (
        {"window": 2, "kernel": 3}, {"window": 1, "kernel": 1, "mix_lambda": 0.5},
        {"window": 3, "mix_lambda": 0.0}, {"window": 4, "kernel": 5, "mix_lambda": 1.0}),
        small={"window": 2, "kernel": 3}),
    "dropkv": Reference(policy_dropkv, (
        {"window": 3, "kernel": 3}, {"window": 1, "kernel": 1}, {"window": 5, "kernel": 5}),
        small={"window": 2, "kernel": 3}),
    "chunkkv": Reference(policy_chunkkv, (
        {"window": 3, "kernel": 3, "chunk": 4}, {"window": 2, "chunk": 1},
        {"window": 1, "kernel": 1, "pooling": "max", "chunk": 3},
        {"window": 4, "kernel": 7, "pooling": "none", "chunk": 5}),
        small={"window": 2, "chunk": 2}),
    "expected_attention": Reference(policy_expected_attention, (
        {"n_sink": 0, "n_future": 3}, {"n_sink": 2, "covariance": False},
        {"n_sink": 1, "vnorm": False, "n_future": 1}), small={"n_sink": 1}),
    "cake": Reference(policy_cake, ({"window": 3}, {"window": 2, "gamma": 0.0},
                                    {"window": 4, "gamma": 5.0}), small={"window": 2}),
    "openvino": Reference(policy_openvino, (
        {"block": 1, "start_blocks": 1, "recent_blocks": 1},
        {"block": 2, "mode": "sum", "snapkv_window": 0},
        {"block": 1, "start_blocks": 2, "recent_blocks": 1, "pool": 1, "snapkv_window": 3},
        {"block": 3, "start_blocks": 1, "recent_blocks": 1, "mode": "sum", "pool": 2},
        {"block": 2, "start_blocks": 1, "recent_blocks": 2, "snapkv_window": 1, "pool": 4}),
        small={"block": 1, "start_blocks": 1, "recent_blocks": 1}),
    "openvino_arkv": Reference(policy_openvino_arkv, (
        {"block": 1, "start_blocks": 1, "recent_blocks": 1},
        {"block": 2, "attention_mass": 0.5, "window_size": 2, "snapkv_window": 0},
        {"block": 1, "start_blocks": 2, "recent_blocks": 1, "pool": 1, "window_size": 1},
        {"block": 3, "start_blocks": 1, "recent_blocks": 1, "attention_mass": 0.0, "pool": 2},
        {"block": 2, "start_blocks": 1, "recent_blocks": 2, "attention_mass": 1.0,
         "snapkv_window": 1, "pool": 4}),
        small={"block": 1, "start_blocks": 1, "recent_blocks": 1}),
    # docs/adding-a-policy.md's example, registered by its test
    "vnorm": Reference(policy_vnorm, ({"recent_ratio": 0.4},)),
    # docs/adding-a-policy.md's per-step example, registered by its test
    "decayed": Reference(policy_decayed, ({"decay": 0.0}, {"decay": 1.0}), gqa=False, one_head=True),
}
