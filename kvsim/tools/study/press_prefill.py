"""kvpress's prefill inside a study: the prompt (or a task's context) compressed by a press
exactly as kvpress runs it (its forward hooks on an eager prefill into a ``DynamicCache``;
SDPA for :data:`~kvsim.tools.study.presses.SDPA`), and the positions it kept read back from
its cache (:func:`kept`), which a :class:`~kvsim.tools.study.model.Kept` cache then holds
with no eviction."""

from __future__ import annotations

import numpy as np

from kvsim.errors import KvsimError
from kvsim.tools.study.presses import MATCH, SDPA


def press_prefill(net, press, context_ids: np.ndarray):
    """kvpress's prefill of ``context_ids`` under ``press`` (its hooks, an eager forward into
    a ``DynamicCache``, as its pipeline does; SDPA for the presses of
    :data:`~kvsim.tools.study.presses.SDPA`);
    returns the compressed cache."""
    import torch
    from transformers import DynamicCache

    from kvsim.models.adapter import attach

    cache = DynamicCache()
    net.set_attn_implementation("sdpa" if type(press).__name__ in SDPA else "eager")
    try:
        with torch.no_grad(), press(net):
            net.model(input_ids=torch.as_tensor(context_ids[None], dtype=torch.long),
                      past_key_values=cache)
    finally:
        attach(net)
    return cache


def positions(cache, context_keys: np.ndarray, layers: list[int], name: str
              ) -> dict[int, np.ndarray]:
    """Per layer of ``layers``, the (H_kv, n) sorted context positions a press's ``cache``
    (of press ``name``) holds: each held key is matched to the nearest of ``context_keys``
    (L, H_kv, at, d), kvsim's prefill keys; the cache's first keys only are read (the
    question and answer may follow)."""
    out = {}
    for layer in layers:
        ref = context_keys[layer].astype(np.float64)
        held = cache.layers[layer].keys[0].double().numpy()  # (H_kv, n, d)
        positions = np.empty(held.shape[:2], np.int64)
        for j in range(held.shape[0]):
            d2 = ((held[j][:, None, :] - ref[j][None]) ** 2).sum(-1)
            positions[j] = d2.argmin(axis=1)
            err = np.sqrt(d2[np.arange(len(positions[j])), positions[j]])
            scale = np.linalg.norm(ref[j][positions[j]], axis=1) + 1e-6
            if (err > MATCH * scale).any() or np.unique(positions[j]).size != positions.shape[1]:
                raise KvsimError(f"press {name}: layer {layer}, KV head {j} holds keys that "
                                 f"are not the context's own (kvsim runs presses that keep a "
                                 f"subset of the context)")
        out[layer] = np.sort(positions, axis=1)
    return out


def kept(net, press, context_ids: np.ndarray, context_keys: np.ndarray,
         layers: list[int]) -> dict[int, np.ndarray]:
    """Run kvpress's prefill of ``context_ids`` under ``press`` (:func:`press_prefill`) and
    return, per layer of ``layers``, the (H_kv, n) sorted context positions its cache kept
    (:func:`positions`)."""
    return positions(press_prefill(net, press, context_ids), context_keys, layers,
                     type(press).__name__)
