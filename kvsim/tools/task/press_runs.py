"""kvpress's presses inside a task trial: the context compressed by kvpress's own prefill,
the positions it kept read back from its cache, and the rows of every press x budget.

Each press runs as kvpress runs it (its forward hooks on an eager prefill into a
``DynamicCache``; SDPA for :data:`~kvsim.tools.task.presses.SDPA`), at the
``compression_ratio`` that keeps exactly ``B`` keys (:func:`~kvsim.tools.task.presses.ratio`);
the kept positions (:func:`kept`) then hold the question and the greedy answer with no
eviction, in kvsim's decoder (``prefill_only``). What a press table may hold, and its
check before any model loads, are in :mod:`kvsim.tools.task.presses`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.errors import KvsimError
from kvsim.tools.task.presses import MATCH, PROTOCOL, SDPA, make, ratio
from kvsim.tools.task.run import empty_caches, predict, protocol_rows


def press_prefill(net, press, context_ids: np.ndarray):
    """kvpress's prefill of ``context_ids`` under ``press`` (its hooks, an eager forward into
    a ``DynamicCache``, as its pipeline does; SDPA for the presses of :data:`SDPA`);
    returns the compressed cache."""
    import torch
    from transformers import DynamicCache

    from kvsim.tools.adapter import attach

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


@dataclass
class Kept:
    """A cache that holds the positions a press kept and every later one (no eviction):
    kvpress's decode after its prefill, as a :class:`~kvsim.tools.closed_loop.model.CachePolicy`."""

    positions: list

    @property
    def cache(self) -> np.ndarray:
        return np.asarray(self.positions, np.int64)

    def admit(self, t: int) -> int:
        self.positions.append(t)
        return -1

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """Nothing to learn: kvpress does not evict after the prefill."""


def press_rows(net, full, prompt, cfg, rows_of: dict) -> list[dict]:
    """Every press x budget of ``cfg`` on one prompt under ``prefill_only``: what the kept
    positions predict and the answers decoded with the question and the answer joining
    without eviction (the row format of :func:`kvsim.tools.task.run.protocol_rows`)."""
    caches = press_caches(net, full, prompt, cfg, rows_of)
    return protocol_rows(net, full, caches, PROTOCOL, cfg.answer_tokens)


def press_caches(net, full, prompt, cfg, rows_of: dict):
    """The :class:`~kvsim.tools.task.run.Caches` of every press x budget of ``cfg`` under
    ``prefill_only``: the positions kvpress's prefill of the context kept (a :class:`Kept`
    per global layer and KV head) and what they predict; ``rows_of``: the question's
    full-cache attention per (global layer, KV head)."""
    at = prompt.ids.size - prompt.question_len
    return held_caches(full, prompt, cfg, rows_of, cfg.presses, lambda pc, b: kept(
        net, make(pc, ratio(at, b)), prompt.ids[:at], full.keys[:, :, :at], full.global_layers))


def held_caches(full, prompt, cfg, rows_of: dict, configs, held_of):
    """The :class:`~kvsim.tools.task.run.Caches` under ``prefill_only`` of every config of
    ``configs`` x budget of ``cfg`` whose kept context positions ``held_of(config, budget)``
    gives (per global layer, (H_kv, n) positions): a :class:`Kept` per global layer and KV
    head, and what the positions predict."""
    caches = empty_caches(full, prompt, cfg, PROTOCOL, configs)
    H_kv = full.keys.shape[1]
    for c, (pc, b) in enumerate(caches.runs):
        held = held_of(pc, b)
        for i, layer in enumerate(full.global_layers):
            for j in range(H_kv):
                positions = held[layer][j]
                predict(caches, (c, i, j), positions, prompt.digits, rows_of[layer, j][
                    np.concatenate(prompt.digits)], prompt.needs_all)
                caches.steppers[c][layer][j] = Kept(positions.tolist())
    return caches
