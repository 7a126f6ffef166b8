"""Small causal attention matrices for the tests (rows are probabilities)."""

from __future__ import annotations

import numpy as np

RECIPES = ("softmax", "heavy", "uniform", "quantised", "onehot", "sparse_ties")


def causal_softmax(logits):
    """Row softmax over k <= q; zero above the diagonal."""
    T = logits.shape[0]
    mask = np.tril(np.ones((T, T), dtype=bool))
    z = np.where(mask, logits, -np.inf)
    z = z - z.max(axis=1, keepdims=True)
    e = np.where(mask, np.exp(z), 0.0)
    return e / e.sum(axis=1, keepdims=True)


def quantised_rows(T, rng, units=16, support=None):
    """Rows whose entries are multiples of 1/units (a power of two), summing to exactly 1.

    Every sum of such entries is exact in float64, so ties in column sums, votes
    and masses are exact whatever the summation order.
    """
    a = np.zeros((T, T))
    for q in range(T):
        keys = np.arange(q + 1) if support is None else support(q, rng)
        counts = rng.multinomial(units, np.full(len(keys), 1.0 / len(keys)))
        a[q, keys] = counts / units
    return a


def make_attention(T, recipe, seed):
    """A (T, T) causal probability matrix from a named recipe."""
    rng = np.random.default_rng(seed)
    if recipe == "softmax":
        return causal_softmax(rng.normal(scale=rng.uniform(0.5, 3.0), size=(T, T)))
    if recipe == "heavy":
        logits = rng.normal(size=(T, T))
        n_heavy = max(1, T // 6)
        heavy = rng.choice(T, size=n_heavy, replace=False)
        logits[:, heavy] += rng.uniform(2.0, 6.0, size=n_heavy)
        logits[:, 0] += 3.0  # attention sink
        logits += 2.0 * np.exp(-(np.arange(T)[:, None] - np.arange(T)[None, :]).clip(0) / 3.0)
        return causal_softmax(logits)
    if recipe == "uniform":
        return np.tril(np.ones((T, T))) / np.arange(1, T + 1)[:, None]
    if recipe == "quantised":
        return quantised_rows(T, rng, units=int(rng.choice([4, 8, 16, 32])))
    if recipe == "onehot":
        # each row puts all its mass on one key: many zero masses and exact ties
        a = np.zeros((T, T))
        for q in range(T):
            a[q, rng.integers(0, q + 1)] = 1.0
        return a
    if recipe == "sparse_ties":
        # mass on a few recurring "heavy" keys and the diagonal, in quarters
        pool = rng.choice(T, size=max(1, T // 4), replace=False)

        def support(q, rng):
            ks = sorted(set([q] + [int(k) for k in pool if k <= q]))
            return np.array(ks)

        return quantised_rows(T, rng, units=4, support=support)
    raise ValueError(recipe)
