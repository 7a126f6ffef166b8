"""The Stepper's query vectors (for policies that read them, such as ``rkv``): a one-line
error when missing or misshapen, and read by reference, so rows written as tokens arrive
give the same caches as rows given up front."""

from __future__ import annotations

import numpy as np
import pytest

from kvsim.errors import KvsimError
from kvsim.protocols.stepping import Stepper

G, T, P, D, B = 2, 30, 12, 4, 10


def prompt(rng):
    A = np.tril(rng.random((G, P, P)) + 0.1)
    return A / A.sum(axis=-1, keepdims=True)


def test_missing_or_misshapen_queries_are_one_line_errors():
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((T, D))
    with pytest.raises(KvsimError, match="^queries: rkv needs the query vectors"):
        Stepper("rkv", B, prompt_attention=prompt(rng), keys=keys, capacity_T=T)
    with pytest.raises(KvsimError) as info:
        Stepper("rkv", B, prompt_attention=prompt(rng), keys=keys,
                queries=np.zeros((G, T - 1, D)), capacity_T=T)
    assert str(info.value) == f"queries: expected shape ({G}, {T}, d) (heads, capacity_T, d), " \
                              f"got ({G}, {T - 1}, {D})"
    with pytest.raises(KvsimError, match=r"^scaling: expected a number or 2 numbers"):
        Stepper("rkv", B, prompt_attention=prompt(rng), keys=keys,
                queries=np.zeros((G, T, D)), scaling=[1.0, 2.0, 3.0], capacity_T=T)


def test_query_rows_written_as_tokens_arrive_give_the_same_caches():
    rng = np.random.default_rng(1)
    A, keys = prompt(rng), rng.standard_normal((T, D))
    queries = rng.standard_normal((G, T, D))
    late = np.zeros_like(queries)
    late[:, :P] = queries[:, :P]
    early = Stepper("rkv", B, prompt_attention=A, keys=keys, queries=queries, scaling=0.7,
                    capacity_T=T)
    lazy = Stepper("rkv", B, prompt_attention=A, keys=keys, queries=late, scaling=0.7,
                   capacity_T=T)
    for t in range(P, T):
        late[:, t] = queries[:, t]
        assert early.admit(t) == lazy.admit(t)
        assert np.array_equal(early.cache, lazy.cache)
        rows = rng.random((G, len(early.cache)))
        for s in (early, lazy):
            s.observe(rows / rows.sum(axis=1, keepdims=True))
    assert len(early.cache) == B
