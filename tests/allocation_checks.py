"""Plain references of budget allocation (AdaKV, PyramidKV) and the scenarios its tests run:
shared by tests/test_allocation.py and tests/test_allocation_edges.py."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np

import reference as ref


def ada_reference(scores: list[list[float]], B: int, fixed: int, floor_share: float) -> list[int]:
    """AdaKV, straight from the rule: each head takes its own top floor(share * (B - fixed))
    selectable keys, then the pooled slots go one by one to the best remaining score of any
    head (ties: lower head, then lower position)."""
    H, slots = len(scores), B - fixed
    if len(scores[0]) <= slots:
        return [B] * H
    own = math.floor(floor_share * slots)
    remaining = []  # (score, head, position) not yet taken
    for h, s in enumerate(scores):
        ranked = sorted(range(len(s)), key=lambda k: (-s[k], k))
        remaining += [(s[k], h, k) for k in ranked[own:]]
    share = [own] * H
    for _ in range(H * (slots - own)):
        best = min(remaining, key=lambda c: (-c[0], c[1], c[2]))
        remaining.remove(best)
        share[best[1]] += 1
    return [fixed + x for x in share]


def pyramid_reference(B: int, fixed: int, beta: float, L: int, T: int) -> list[int]:
    """PyramidKV, with exact fractions: a line from 2B - b_min down to b_min, floored, the
    remainder one token each to the earliest layers; then no layer above T, the tokens
    above it one by one to the earliest layer below the most-served count with room."""
    b_min = fixed + math.ceil(Fraction(B - fixed) / Fraction(beta))
    b_max = 2 * B - b_min
    caps = [math.floor(b_max - Fraction((b_max - b_min) * layer, L - 1)) for layer in range(L)]
    for layer in range(L * B - sum(caps)):
        caps[layer] += 1
    cut = sum(max(c - T, 0) for c in caps)
    caps = [min(c, T) for c in caps]
    given = [0] * L  # rounds each layer has received
    for _ in range(cut):
        layer = min((g, i) for i, (g, c) in enumerate(zip(given, caps)) if c < T)[1]
        caps[layer] += 1
        given[layer] += 1
    return caps


def selectable_scores(policy: str, p: np.ndarray, P: int, B: int, params: dict):
    """(fixed, scores of the selectable prompt keys) of one head's dense attention ``p``."""
    if policy == "h2o":
        r = int(params["recent_ratio"] * B)
        return r, ref.prompt_colsum(p, P)[:max(P - r, 0)]
    if policy == "h2o_offline":  # column sums over every query
        r = int(params["recent_ratio"] * B)
        return r, [ref.sum_seq(p[k:, k]) for k in range(max(P - r, 0))]
    if policy == "snapkv":
        w = min(params["window"], P)
        votes = [ref.sum_seq(p[P - w:P, k]) for k in range(P - w)]
        return w, ref.pool_votes(votes, params["kernel"], params["pooling"])
    return 0, [float(x) for x in p[P - 1, :P]]  # tova


def dense_scenario(tmp_path: Path, attention: np.ndarray, P: int, budgets, policies: str,
                   allocation_lines: str) -> Path:
    """A scenario over ``attention`` (saved as a matrix source) with one experiment."""
    np.save(tmp_path / "a.npy", attention)
    (tmp_path / "s.toml").write_text(
        f'[attention]\nsource = "matrix"\npath = "a.npy"\n{policies}\n'
        f"[[experiment]]\nprompt_len = {P}\nbudgets = {list(budgets)}\n{allocation_lines}\n")
    return tmp_path / "s.toml"


def random_attention(rng, H: int, T: int) -> np.ndarray:
    """(H, T, T) causal attention rows with a few heavy keys."""
    a = np.tril(rng.random((H, T, T)) ** 4 + 1e-3)
    return a / a.sum(axis=2, keepdims=True)
