"""``heads = "uniform"``: one ranking for every KV head of a layer, per step and in pages,
against the plain reference (``uniform_caches``: each KV head's rule over the one cache,
ranked by the sum of their scores), on layers of several KV heads; its refusals."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from reference import uniform_caches
from test_protocols import attention

from kvsim import ScenarioError, load_scenario
from kvsim.numerics.field import dense_field
from kvsim.policies import POLICIES
from kvsim.protocols.run import make_group, resolve_params, run_policy
from kvsim.protocols.settings import problem

PARAMS = {"h2o": {"recent_ratio": 0.25}, "h2o_offline": {"recent_ratio": 0.25}, "tova": {}}


def layer_runs(As, name, params, B, P):
    """kvsim's trace of every KV head of the layer over ``As`` (one query head each)."""
    T = As.shape[1]
    field = dense_field(As, As.shape[0])
    policy = POLICIES[name]
    return [run_policy(policy, make_group(field, kv, P, np.zeros((len(As), T), bool), {},
                                          snap_budget=B, snap_steps=np.arange(T - P)),
                       B, resolve_params(policy, params)) for kv in range(len(As))]


def cached(trace) -> list[list[int]]:
    """The cache at each decode step, sorted."""
    return [sorted(int(k) for k in row if k >= 0) for row in trace.snapshots]


def check(As, name, params, B, P):
    T = As.shape[1]
    full = {**PARAMS[name], **params, "heads": "uniform"}
    prefill, steps = uniform_caches(list(As), name, P, T, B, full)
    ctx = f"{name} {full} T={T} P={P} B={B}"
    for kv, got in enumerate(layer_runs(As, name, full, B, P)):
        assert cached(got) == [sorted(s) for s in steps], (ctx, kv)
        mass = [sum(As[kv, P + i, k] for k in sorted(s)) for i, s in enumerate(steps)]
        np.testing.assert_allclose(got.mass[0], mass, rtol=0, atol=1e-9, err_msg=ctx)
        assert got.kept.tolist() == (sorted(steps[-1]) if steps else sorted(prefill)), ctx


@pytest.mark.parametrize("name", sorted(PARAMS))
@pytest.mark.parametrize("page", [1, 2, 3])
def test_uniform_heads_match_the_reference(name, page):
    rng = np.random.default_rng([len(name), page])
    for _ in range(12):
        kv_heads, T = int(rng.integers(1, 4)), int(rng.integers(6, 36))
        P = int(rng.integers(0, T + 1))
        low = max(4, 2 * page)
        B = int(rng.integers(low, max(low + 1, P + 3)))
        params = {"page": page} if page != 1 else {}
        if problem(POLICIES[name], {**PARAMS[name], **params, "heads": "uniform"}, B, P, T):
            continue
        check(np.stack([attention(rng, T) for _ in range(kv_heads)]), name, params, B, P)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), kv_heads=st.integers(2, 3), T=st.integers(2, 30),
       B=st.integers(4, 12), name=st.sampled_from(sorted(PARAMS)), data=st.data())
def test_one_cache_for_the_layer(seed, kv_heads, T, B, name, data):
    """Every KV head holds the same cache at every step, never more than B keys; with one
    KV head, uniform is the per-head rule."""
    rng = np.random.default_rng(seed)
    P = data.draw(st.integers(0, T))
    As = np.stack([attention(rng, T) for _ in range(kv_heads)])
    traces = layer_runs(As, name, {**PARAMS[name], "heads": "uniform"}, B, P)
    for trace in traces:
        assert np.array_equal(trace.snapshots, traces[0].snapshots)
        assert trace.cache_size.max(initial=0) <= B
    one = layer_runs(As[:1], name, {**PARAMS[name], "heads": "uniform"}, B, P)[0]
    per_head = layer_runs(As[:1], name, PARAMS[name], B, P)[0]
    assert cached(one) == cached(per_head)
    np.testing.assert_allclose(one.mass, per_head.mass, rtol=0, atol=1e-12)  # slot orders differ


@pytest.mark.parametrize("name, reason", [
    ("window", "a position rule already decides alike"),
    ("snapkv", "no per-key scores"),
    ("random", "seeded per KV head"),
])
def test_refusals(name, reason):
    policy = POLICIES[name]
    found = problem(policy, {**resolve_params(policy, {}), "heads": "uniform"}, 64, 100, 200)
    assert found is not None and found[0] == "heads" and reason in found[1]


def test_only_page_combines_with_heads():
    h2o = POLICIES["h2o"]
    params = resolve_params(h2o, {})
    assert problem(h2o, {**params, "heads": "uniform", "page": 4}, 64, 100, 200) is None
    found = problem(h2o, {**params, "heads": "uniform", "interval": 4}, 64, 100, 200)
    assert found is not None and found[0] == "heads"


def test_ada_allocation_refuses_uniform_heads(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[attention]\nsource = "field"\nT = 64\nheads = 2\nkv_heads = 2\n'
                    '[policies.h2o]\nheads = "uniform"\n[[experiment]]\nname = "e"\n'
                    'prompt_len = 32\nbudgets = [16]\nallocation = "ada"\n')
    with pytest.raises(ScenarioError) as info:
        load_scenario(path)
    assert any("heads = \"uniform\" or filtering" in line for line in info.value.lines())


STEPPED = ("h2o", "tova")  # h2o_offline is clairvoyant: no closed loop


def stepped(As, name, params, B, P, kv_heads=None):
    """(prefill selection, [C_t]) of a UniformLayer fed the layer's rows one step at a
    time, as a decoder feeds it (each view admits; each KV head observes its own row);
    ``kv_heads``: the KV heads sharing the cache (default: all)."""
    from kvsim.protocols.stepping import UniformLayer

    T = As.shape[1]
    heads = list(range(As.shape[0])) if kv_heads is None else kv_heads
    layer = UniformLayer(name, B, params, prompt_attention=As[:, None, :P, :P].copy(),
                         capacity_T=T, kv_heads=kv_heads)
    views = [layer.head(j) for j in heads]
    prefill = sorted(views[0].cache.tolist())
    steps = []
    for t in range(P, T):
        for view in views:
            view.admit(t)
        caches = [view.cache for view in views]
        assert all(sorted(c.tolist()) == sorted(caches[0].tolist()) for c in caches)
        assert len(caches[0]) <= B
        steps.append(sorted(caches[0].tolist()))
        for j, view in zip(heads, views):
            view.observe(As[j, t, caches[heads.index(j)]][None])
    return prefill, steps


@pytest.mark.parametrize("name", STEPPED)
@pytest.mark.parametrize("page", [1, 2, 3])
def test_a_stepped_layer_is_the_reference(name, page):
    """UniformLayer, stepped from the rows of each KV head's full attention over the one
    cache, holds the reference's cache at every step (and its prefill), per token and in
    pages."""
    from kvsim.protocols.stepping import UniformLayer

    rng = np.random.default_rng([len(name), 7, page])
    compared = 0
    for _ in range(25):
        kv_heads, T = int(rng.integers(1, 4)), int(rng.integers(6, 36))
        P = int(rng.integers(1, T + 1))
        B = int(rng.integers(max(4, 2 * page), max(5, 2 * page + 1, P + 3)))
        params = {**PARAMS[name], "heads": "uniform", **({"page": page} if page != 1 else {})}
        if problem(POLICIES[name], resolve_params(POLICIES[name], params), B, P, T):
            continue
        As = np.stack([attention(rng, T) for _ in range(kv_heads)])
        ref_prefill, ref_steps = uniform_caches(list(As), name, P, T, B, params)
        got_prefill, got_steps = stepped(As, name, params, B, P)
        ctx = f"{name} T={T} P={P} B={B} kv_heads={kv_heads} page={page}"
        assert got_prefill == sorted(ref_prefill), ctx
        assert got_steps == [sorted(s) for s in ref_steps], ctx
        compared += 1
    assert compared >= 12
    layer = UniformLayer(name, 8, {**PARAMS[name], "heads": "uniform"},
                         prompt_attention=np.ones((2, 1, 4, 4)) / 4, capacity_T=8)
    with pytest.raises(Exception, match="expected token 4"):
        layer.head(1).admit(5)


@pytest.mark.parametrize("name", STEPPED)
@pytest.mark.parametrize("page", [2, 3])
def test_one_kv_heads_pages_stepped_are_the_reference(name, page):
    """``page`` alone: a UniformLayer of one KV head (``kv_heads = [j]``) holds the paged
    reference's cache at every step, whatever the other KV heads attend to."""
    from reference import paged_caches

    rng = np.random.default_rng([len(name), 11, page])
    compared = 0
    for _ in range(25):
        kv_heads, T = int(rng.integers(1, 4)), int(rng.integers(6, 36))
        P = int(rng.integers(1, T + 1))
        B = int(rng.integers(2 * page, max(2 * page + 1, P + 3)))
        params = {**PARAMS[name], "page": page}
        if problem(POLICIES[name], resolve_params(POLICIES[name], params), B, P, T):
            continue
        As = np.stack([attention(rng, T) for _ in range(kv_heads)])
        j = int(rng.integers(0, kv_heads))
        ref_prefill, ref_steps = paged_caches(As[j], name, P, T, B, params)
        got_prefill, got_steps = stepped(As, name, params, B, P, kv_heads=[j])
        ctx = f"{name} T={T} P={P} B={B} j={j} page={page}"
        assert got_prefill == sorted(ref_prefill), ctx
        assert got_steps == [sorted(s) for s in ref_steps], ctx
        compared += 1
    assert compared >= 12


def test_a_layer_stepper_refuses_a_mismatch():
    from kvsim.errors import KvsimError
    from kvsim.protocols.stepping import UniformLayer

    A = np.ones((2, 1, 4, 4)) / 4
    with pytest.raises(KvsimError, match="heads"):  # per KV head without pages
        UniformLayer("h2o", 8, {}, prompt_attention=A, capacity_T=8, kv_heads=[0])
    with pytest.raises(KvsimError, match="heads"):  # uniform over some KV heads only
        UniformLayer("h2o", 8, {"heads": "uniform"}, prompt_attention=A, capacity_T=8,
                     kv_heads=[1])


def test_a_stepper_refuses_uniform_heads():
    from kvsim.errors import KvsimError
    from kvsim.protocols.stepping import Stepper

    for params in ({"heads": "uniform"}, {"page": 2}):
        with pytest.raises(KvsimError, match="UniformLayer"):
            Stepper("h2o", 8, params, prompt_attention=np.ones((1, 4, 4)) / 4, capacity_T=8)
    with pytest.raises(KvsimError, match="BlockLayer"):
        Stepper("openvino", 79, {}, prompt_attention=np.ones((1, 4, 4)) / 4, capacity_T=8)
