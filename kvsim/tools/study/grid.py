"""The stepper grid of a study: one :class:`~kvsim.protocols.stepping.Stepper` per run
(policy x budget), global layer and KV head, each fed the full run's attention of its
prompt (a policy that chooses one set for the whole layer, ``Policy.layer``: the layer's),
with the stores of the vectors its policy reads; for ``heads = "uniform"``, one
:class:`~kvsim.protocols.stepping.UniformLayer` per run and layer (with pages alone, one per
run, layer and KV head), and for a rule with one cache per layer (``Policy.layer_cache``),
one :class:`~kvsim.protocols.stepping.BlockLayer` per run and layer, each KV head its view."""

from __future__ import annotations

import numpy as np

from kvsim.engine.experiments import random_seed
from kvsim.protocols import settings
from kvsim.protocols.run import get_policy
from kvsim.protocols.stepping import BlockLayer, LayerView, Stepper, UniformLayer
from kvsim.scenario.reader import PolicyConfig
from kvsim.tools.study.model import FullRun


def needing(runs: list[tuple[PolicyConfig | None, int]], vector: str) -> list[int]:
    """The indices of the runs whose policy reads ``vector`` ("keys", "values",
    "queries"); a run without a policy (None: the full-cache reference; a kvpress press's
    run) reads none."""
    return [c for c, (cfg, _) in enumerate(runs)
            if isinstance(cfg, PolicyConfig) and vector in get_policy(cfg.kind).needs]


def query_runs(runs: list[tuple[PolicyConfig | None, int]]) -> list[int]:
    """The indices of the runs whose policy reads query vectors."""
    return needing(runs, "queries")


def layer_wide(cfg) -> bool:
    """Whether run ``cfg`` reads its layer's prompt attention (every KV head's): a policy
    that chooses one set for the whole layer (``Policy.layer``) or keeps one cache for it
    (``Policy.layer_cache``), ``heads = "uniform"``, or pages."""
    if not isinstance(cfg, PolicyConfig):
        return False
    spec = get_policy(cfg.kind)
    return bool(spec.layer or spec.layer_cache is not None
                or settings.steps_in_model(cfg.params))


def grid_stepper(full: FullRun, cfg: PolicyConfig, budget: int, c: int, layer: int, j: int,
                 attention: np.ndarray, at: int, keys: np.ndarray, values: np.ndarray,
                 queries: dict, gqa: str, seed: int, capacity: int,
                 passes: dict | None = None, stack: np.ndarray | None = None,
                 layers: dict | None = None) -> Stepper | LayerView:
    """The stepper of run ``c`` (``cfg`` at ``budget``) on ``layer`` and KV head ``j``,
    compressing after ``at`` prompt positions whose full-cache ``attention`` (G, at, at) it
    is given, or for a policy that chooses one set for the whole layer (``Policy.layer``)
    the layer's ``stack`` (H_kv, G, at, at) of which it is KV head ``j``;
    ``keys``/``values`` (L, C, H_kv, ...): the runs' stores; ``queries``: the query stores
    of the runs that read them (:func:`query_runs`); its random draws seeded per layer and
    KV head, as in the simulator; room for ``capacity`` positions. A run stepped a layer at
    a time (:func:`layer_wide` but ``Policy.layer``): KV head ``j``'s view of the run's
    :class:`BlockLayer` or :class:`UniformLayer` on ``layer`` (with pages alone, on KV
    head ``j``), made once from ``stack`` and kept in ``layers``."""
    spec = get_policy(cfg.kind)
    uniform = settings.layer_wide(cfg.params)  # heads = "uniform"; else pages on KV head j
    if spec.layer_cache is not None or settings.steps_in_model(cfg.params):
        key = (c, layer) if spec.layer_cache is not None or uniform else (c, layer, j)
        if key not in layers:
            H_kv = stack.shape[0]
            if spec.layer_cache is not None:
                layers[key] = BlockLayer(
                    cfg.kind, budget, cfg.params, prompt_attention=stack,
                    capacity_T=capacity, gqa=gqa, passes=passes,
                    keys=[keys[layer, c, i] for i in range(H_kv)] if "keys" in spec.needs
                    else None)
            else:
                layers[key] = UniformLayer(
                    cfg.kind, budget, cfg.params, prompt_attention=stack, capacity_T=capacity,
                    keys=[keys[layer, c, i] for i in range(H_kv)],
                    values=[values[layer, c, i] for i in range(H_kv)],
                    queries=[queries[c][layer, i] for i in range(H_kv)] if c in queries
                    else None, scaling=full.geometry[layer].scaling, gqa=gqa,
                    seeds=[random_seed(seed, i, layer) for i in range(H_kv)],
                    rope=[full.prompt_rope(layer, i, at) for i in range(H_kv)], passes=passes,
                    kv_heads=None if uniform else [j])
        return layers[key].head(j)
    return Stepper(cfg.kind, budget, cfg.params,
                   prompt_attention=stack if spec.layer else attention,
                   kv_head=j if spec.layer else None,
                   keys=keys[layer, c, j], values=values[layer, c, j],
                   queries=queries[c][layer, j] if c in queries else None,
                   scaling=full.geometry[layer].scaling, gqa=gqa,
                   seed=random_seed(seed, j, layer), capacity_T=capacity,
                   rope=full.prompt_rope(layer, j, at), passes=passes)
