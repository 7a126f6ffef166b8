"""kvsim's rkv, dropkv and chunkkv against NumPy transcriptions of their authors' PyTorch
code (tests/author_code.py): the same scores (to rounding) and the same kept sets, on
random q.k fields with GQA, at prefill and, for rkv, step by step through decoding."""

from __future__ import annotations

import math

import numpy as np
import pytest
from author_code import (chunk_scores, dropkv_scores, rkv_update_kv, snapkv_scores,
                         topk_indices)
from policy_checks import qk_field, run_kvsim
from reference import policy_chunkkv, qk_source

from kvsim.errors import KvsimError
from kvsim.numerics.decode import observed_outputs
from kvsim.numerics.field import FieldData
from kvsim.numerics.kernels import GQA_MEAN
from kvsim.policies import POLICIES, chunkkv, dropkv, rkv
from kvsim.policies.rows import head_rows
from kvsim.protocols.run import make_group, resolve_params
from kvsim.protocols.stepping import Stepper


def model_field(rng, T, G, d=8, kv_heads=1) -> FieldData:
    """A q.k field whose logits are ``q . k / sqrt(d)``, as the authors' code computes them
    (``kv_heads`` KV heads, ``G`` query heads each)."""
    fields = [qk_field(rng, T, G, d=d, dv=d) for _ in range(kv_heads)]
    if kv_heads == 1:
        return fields[0]._replace(qk_scale=np.full(G, 1.0 / math.sqrt(d)))
    return fields[0]._replace(
        queries=np.concatenate([f.queries for f in fields]),
        keys=np.concatenate([f.keys for f in fields]),
        values=np.concatenate([f.values for f in fields]),
        value_heads=np.ones(kv_heads, bool), qk_scale=np.full(G * kv_heads, 1 / math.sqrt(d)),
        key_bias=np.zeros((G * kv_heads, T)), distance=np.zeros((G * kv_heads, T)),
        noise_kind=np.zeros(G * kv_heads, np.int64), noise_scale=np.zeros(G * kv_heads),
        noise_key=np.zeros(G * kv_heads, np.uint64))


def tensors(field: FieldData, kv: int = 0):
    """The code's layouts for KV head ``kv``: queries (1, G, T, d), keys/values (1, 1, T, d)."""
    G = field.group
    q = field.queries[kv * G:(kv + 1) * G].astype(np.float64)[None]
    k = field.keys[kv].T.astype(np.float64)[None, None]
    v = field.values[kv].astype(np.float64)[None, None]
    return q, k, v


def group_of(field: FieldData, P: int, kv: int = 0):
    """KV head ``kv``'s group, prompt ``P``, mean over its query heads."""
    return make_group(field, kv, P, np.zeros((field.heads, field.T), bool), {}, GQA_MEAN)


@pytest.mark.parametrize("seed", range(12))
def test_rkv_prefill_matches_the_code(seed):
    rng = np.random.default_rng(seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(12, 48))
    field = model_field(rng, T, G)
    q, k, _ = tensors(field)
    for budget in sorted({9, int(rng.integers(9, T)), T - 1}):
        kept = rkv_update_kv(q[:, :, -8:], k, budget)[0]
        got = run_kvsim(field, "rkv", {}, budget, T, "mean", [])
        assert np.array_equal(got.kept, np.sort(kept)), (seed, budget)


@pytest.mark.parametrize("seed", range(12))
def test_rkv_scores_match_the_code(seed):
    """The score of every non-window key, to rounding."""
    from author_code import pool1d, rkv_attention_scores, rkv_similarity, softmax
    rng = np.random.default_rng(100 + seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(10, 40))
    field = model_field(rng, T, G)
    q, k, _ = tensors(field)
    attn = rkv_attention_scores(q[:, :, -8:], k)
    a = pool1d(softmax(attn[:, :, -8:, :-8], axis=-1).mean(axis=-2), 7, "max")
    final = a * 0.07 - rkv_similarity(k)[:, :-8] * (1 - 0.07)
    group = group_of(field, T)
    ours = rkv.prompt_scores(group.keys, group.queries, group.qk_scale, T,
                             resolve_params(POLICIES["rkv"], {}))
    np.testing.assert_allclose(ours, final[0, 0], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_rkv_decode_matches_the_code_step_by_step(seed):
    """The code's decode-time compression (its query cache: the 8 newest queries), its
    cache kept in position order as kvsim keeps it, against kvsim's cache at every step."""
    rng = np.random.default_rng(200 + seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(20, 44))
    P = int(rng.integers(0, T - 4))
    budget = int(rng.integers(9, 16))
    field = model_field(rng, T, G)
    q, k, _ = tensors(field)
    got = run_kvsim(field, "rkv", {}, budget, P, "mean", [])
    cache = np.arange(P)
    if P > budget:
        cache = np.sort(rkv_update_kv(q[:, :, P - 8:P], k[:, :, :P], budget)[0])
    for step, t in enumerate(range(P, T)):
        cache = np.append(cache, t)
        kept = rkv_update_kv(q[:, :, max(0, t - 7):t + 1], k[:, :, cache], budget)
        if kept is not None:
            cache = np.sort(cache[kept[0]])
        snap = got.snapshots[step]
        assert np.array_equal(np.sort(snap[snap >= 0]), cache), (seed, t)


@pytest.mark.parametrize("seed", range(8))
def test_rkv_interval_matches_the_code_buffer(seed):
    """Under ``interval = N`` the code's schedule: keys accumulate to ``B + N`` (the incoming
    one counted), then the buffer is compressed to ``B`` at once, ranked with the 8 newest
    queries (kvsim evicts before t attends, so its compression takes t's query too)."""
    rng = np.random.default_rng(400 + seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(30, 60))
    P = int(rng.integers(0, T - 8))
    budget, N = int(rng.integers(9, 16)), int(rng.choice([2, 4, 7]))
    field = model_field(rng, T, G)
    q, k, _ = tensors(field)
    got = run_kvsim(field, "rkv", {"interval": N}, budget, P, "mean", [])
    cache = np.arange(P)
    if P > budget:
        cache = np.sort(rkv_update_kv(q[:, :, P - 8:P], k[:, :, :P], budget)[0])
    for step, t in enumerate(range(P, T)):
        cache = np.append(cache, t)
        if len(cache) >= budget + N:
            cache = np.sort(cache[rkv_update_kv(q[:, :, max(0, t - 7):t + 1], k[:, :, cache],
                                                budget)[0]])
        snap = got.snapshots[step]
        assert np.array_equal(np.sort(snap[snap >= 0]), cache), (seed, t)


@pytest.mark.parametrize("seed", range(12))
def test_dropkv_matches_the_code(seed):
    rng = np.random.default_rng(300 + seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(3, 50))
    window = int(rng.choice([32, 4, 1]))
    field = model_field(rng, T, G)
    q, k, v = tensors(field)
    params = resolve_params(POLICIES["dropkv"], {"window": window})
    pooled, protected, size = dropkv_scores(q, k, v, window_size=window)
    ours = dropkv.drop_scores(group_of(field, T), params)
    # The code expands ||v - o||^2 into three terms: with p near 1 (weights up to 1e12) the
    # expansion loses digits that kvsim's direct difference keeps.
    tolerance = 1e-12 * (size[0, 0] + 1.0)
    assert (np.abs(ours - pooled[0, 0]) <= tolerance).all(), (ours, pooled[0, 0])
    w = min(window, T)
    checked = 0
    for budget in sorted({window + 1, int(rng.integers(window + 1, max(window + 2, T + 2))),
                          max(T, window + 1)}):
        got = run_kvsim(field, "dropkv", {"window": window}, budget, T, "mean", [])
        order = topk_indices(protected[0, 0], T)
        expected = np.sort(order[:min(budget, T)])
        if budget < T:  # unless the code's rounding decides the last kept key
            gap = protected[0, 0, order[budget - 1]] - protected[0, 0, order[budget]]
            if gap <= tolerance[order[budget - 1]] + tolerance[order[budget]]:
                continue
        assert np.array_equal(got.kept, expected), (seed, budget, w)
        checked += 1
    assert checked > 0


def layer_sources(field: FieldData):
    """The reference's source of every KV head of a layer."""
    G = field.group
    return [qk_source(field.queries[kv * G:(kv + 1) * G], field.keys[kv].T, field.values[kv],
                      field.qk_scale[kv * G:(kv + 1) * G]) for kv in range(field.heads // G)]


@pytest.mark.parametrize("seed", range(10))
def test_chunkkv_matches_the_code(seed):
    """The layer's summed SnapKV scores and the chunk scores of the prefix, to rounding
    (kvpress averages the window's attention where kvsim's snapkv sums it: a factor w),
    and the pinned chunks: the code's top chunks, the same in every KV head."""
    rng = np.random.default_rng(400 + seed)
    G, kv_heads = int(rng.integers(1, 4)), int(rng.integers(1, 4))
    T = int(rng.integers(70, 130))
    field = model_field(rng, T, G, kv_heads=kv_heads)
    q = field.queries.astype(np.float64)[None]
    k = field.keys.transpose(0, 2, 1).astype(np.float64)[None]
    params = resolve_params(POLICIES["chunkkv"], {})
    w, C = 64, 20
    code = snapkv_scores(q, k)  # (1, H_kv, T), the window padded
    ours = chunkkv.layer_scores(group_of(field, T), params) / w
    np.testing.assert_allclose(ours, code[0, :, :-w].sum(axis=0), rtol=1e-9, atol=1e-15)
    code_chunks = chunk_scores(code[:, :, :-w], C)[0]
    np.testing.assert_allclose(chunkkv.chunk_scores(ours, C), code_chunks, rtol=1e-9)
    for budget in sorted({w + 1, w + C, int(rng.integers(w + 1, T + 1))}):
        n_chunks = (budget - w) // C
        if T <= budget:
            continue
        chosen = topk_indices(code_chunks, n_chunks)
        pinned = sorted(p for c in chosen for p in range(c * C, min(T - w, (c + 1) * C)))
        for kv in range(kv_heads):
            kept = POLICIES["chunkkv"].run(group_of(field, T, kv), budget, params).kept
            assert kept.tolist() == pinned + list(range(T - w, T)), (seed, budget, kv)


def chunkkv_layer(rng, shortest: int, longest: int):
    """A random several-KV-head layer of ``shortest`` to ``longest`` tokens, its reference
    sources and chunkkv's parameters: (field, sources, params, T, KV heads)."""
    G, kv_heads = int(rng.integers(1, 3)), int(rng.integers(2, 4))
    T = int(rng.integers(shortest, longest))
    field = model_field(rng, T, G, kv_heads=kv_heads)
    params = {"window": int(rng.integers(1, 5)), "kernel": 3, "pooling": "avg",
              "chunk": int(rng.integers(1, 6))}
    return field, layer_sources(field), params, T, kv_heads


@pytest.mark.parametrize("seed", range(8))
def test_chunkkv_layer_reference(seed):
    """Every KV head of a several-head layer against the plain reference, step by step."""
    rng = np.random.default_rng(500 + seed)
    field, sources, params, T, kv_heads = chunkkv_layer(rng, 10, 40)
    for P in sorted({0, int(rng.integers(0, T + 1)), T}):
        for budget in sorted({params["window"] + 1, int(rng.integers(params["window"] + 1, T + 2))}):
            for kv in range(kv_heads):
                group = make_group(field, kv, P, np.zeros((field.heads, T), bool), {}, GQA_MEAN,
                                   snap_budget=budget, snap_steps=np.arange(T - P))
                got = POLICIES["chunkkv"].run(group, budget, resolve_params(POLICIES["chunkkv"],
                                                                            params))
                prefill, steps = policy_chunkkv(sources[kv], P, T, budget, "mean", layer=sources,
                                                **params)
                ours = [sorted(int(x) for x in row if x >= 0) for row in got.snapshots]
                assert ours == [sorted(c) for c in steps], (seed, P, budget, kv)
                assert got.kept.tolist() == sorted(steps[-1] if steps else prefill)


@pytest.mark.parametrize("seed", range(6))
def test_chunkkv_steps_inside_a_model_as_the_layer_reference(seed):
    """One Stepper per KV head, each given the layer's prompt attention (every KV head's
    group) and its ``kv_head``, as a model steps them: the plain reference's prefill and
    caches at every step, the same chunks pinned in every KV head of the layer. Without the
    layer's attention the Stepper refuses it in one line."""
    rng = np.random.default_rng(700 + seed)
    field, sources, params, T, kv_heads = chunkkv_layer(rng, 20, 50)
    layer = np.stack([s.probs for s in sources])  # (H_kv, G, T, T)
    for P in sorted({int(rng.integers(params["window"] + 1, T)), T}):
        for budget in sorted({params["window"] + 1, int(rng.integers(params["window"] + 1, P + 1))}):
            pinned = []
            for kv in range(kv_heads):
                stepper = Stepper("chunkkv", budget, params, capacity_T=T, kv_head=kv,
                                  prompt_attention=layer[:, :, :P, :P].copy())
                prefill, steps = policy_chunkkv(sources[kv], P, T, budget, "mean", layer=sources,
                                                **params)
                assert sorted(stepper.cache.tolist()) == sorted(prefill), (seed, P, budget, kv)
                pinned.append(sorted(p for p in prefill if p < P - params["window"]))
                for t, expected in zip(range(P, T), steps):
                    stepper.admit(t)
                    cache = stepper.cache
                    assert sorted(cache.tolist()) == sorted(expected), (seed, P, budget, kv, t)
                    stepper.observe(np.ascontiguousarray(sources[kv].probs[:, t, cache]))
            assert all(p == pinned[0] for p in pinned)  # one chunk choice for the layer
    with pytest.raises(KvsimError) as err:
        Stepper("chunkkv", 8, params, prompt_attention=layer[0, :, :4, :4].copy(), capacity_T=T)
    assert str(err.value).startswith("prompt_attention: chunkkv chooses one set for the layer "
                                     "from every KV head's attention: expected the layer's")
    with pytest.raises(KvsimError, match=r"kv_head: expected an integer in \[0, "):
        Stepper("chunkkv", 8, params, prompt_attention=layer[:, :, :4, :4].copy(),
                kv_head=kv_heads, capacity_T=T)


@pytest.mark.parametrize("seed", range(6))
def test_dropkv_term_is_the_output_change_of_dropping_the_key(seed):
    """DropKV's term for (query i, key j) is the squared change of kvsim's observed output
    o~ when the cache is every key but j: the output-error metric, turned into a rule
    (up to its 1e-6 in the denominator)."""
    rng = np.random.default_rng(600 + seed)
    G, T = int(rng.integers(1, 4)), int(rng.integers(4, 30))
    field = model_field(rng, T, G)
    group = group_of(field, T)
    values = field.values[0]
    q = T - 1
    for g, row in enumerate(head_rows(group, q)):
        term = np.zeros(q + 1)
        dropkv.add_drop_scores(row, q, values, term)
        full = np.zeros((1, values.shape[1]))
        everything = np.arange(q + 1)
        observed_outputs(values, everything, q + 1, row[None].copy(), np.ones(1), full)
        for j in range(q + 1):
            if row[j] > 0.9:  # near 1, the 1e-6 moves the weight by more than 2e-5
                continue
            rest = np.delete(everything, j)
            obs = row[rest][None].copy()
            mass = np.array([obs.sum()])
            dropped = np.zeros((1, values.shape[1]))
            observed_outputs(values, rest, q, obs, mass, dropped)
            change = np.sum((dropped - full) ** 2)
            np.testing.assert_allclose(term[j], change, rtol=1e-4, atol=1e-12)
