"""The open loop on the full-cache run: kvsim's own simulator on every global layer.

Each layer's post-RoPE queries, keys and values from :func:`~kvsim.tools.study.model.prefill`
become a trace field (:func:`kvsim.attention.trace.layer_field`), and every policy runs on it
through the simulator's code path (:func:`kvsim.protocols.run.run_budgets`, invariants
checked), exactly as ``kvsim`` runs a recorded trace. Sliding-window layers are left out:
policies do not compress them (their window is their cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.attention.trace import layer_field
from kvsim.engine.storage import run_quantised
from kvsim.engine.experiments import random_seed
from kvsim.errors import KvsimError
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.quantize import Quantize
from kvsim.protocols.run import get_policy, make_group, run_budgets


@dataclass
class OpenLoop:
    """Per decode step, global layer and query head: ``mass`` and relative output ``error``,
    each (global layers, H, steps); ``kept``: the final cache of each global layer and KV
    head."""

    mass: np.ndarray
    error: np.ndarray
    kept: list[list[np.ndarray]]


def open_loop(full, prompt_len: int, kind: str, params: dict, budgets: list[int],
              gqa: str = "mean", quantize: Quantize | None = None, seed: int = 0
              ) -> dict[int, OpenLoop]:
    """Run policy ``kind`` at every budget on every global layer and KV head of the full
    run (its cache stored by KIVI if ``quantize``; a seeded policy seeded per layer and KV
    head as in the closed loop)."""
    policy = get_policy(kind)
    _, H, T, _ = full.queries.shape
    layers = full.global_layers
    H_kv, G, steps = full.keys.shape[1], full.group, T - prompt_len
    out = {b: OpenLoop(np.zeros((len(layers), H, steps)), np.zeros((len(layers), H, steps)),
                       []) for b in budgets}
    none = np.zeros((H, T), bool)
    for i, layer in enumerate(layers):
        geometry = full.geometry[layer]
        if geometry.softcap:
            raise KvsimError(f"open loop: layer {layer} softcaps its attention logits "
                             f"({geometry.softcap:g}), which the simulator's field does not "
                             f"model")
        rope = None if full.pre_rope_queries is None else (full.pre_rope_queries[layer],
                                                            *full.rope[layer])
        field = layer_field(full.queries[layer], full.keys[layer], full.values[layer],
                            geometry.scaling, rope)
        passes: dict = {}
        for b in budgets:
            out[b].kept.append([])
        for j in range(H_kv):
            group = make_group(field, j, prompt_len, none, passes, GQA_MODES[gqa],
                               random_seed(seed, j, layer))
            traces = run_budgets(policy, group, budgets, params) if quantize is None else [
                run_quantised(policy, group, b, None, params, False, "the model", quantize)
                for b in budgets]
            for b, trace in zip(budgets, traces):
                out[b].mass[i, j * G:(j + 1) * G] = trace.mass
                out[b].error[i, j * G:(j + 1) * G] = trace.error
                out[b].kept[i].append(trace.kept)
    return out
