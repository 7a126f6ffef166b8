"""kvpress's presses inside a task trial: the context compressed by kvpress's own prefill,
the positions it kept read back from its cache, and the rows of every press x budget.

Each press runs as kvpress runs it (:func:`~kvsim.tools.study.press_prefill.kept`), at the
``compression_ratio`` that keeps exactly ``B`` keys (:func:`~kvsim.tools.study.presses.ratio`);
the kept positions then hold the question and the greedy answer with no eviction, in
kvsim's decoder (``prefill_only``). What a press table may hold, and its check before any
model loads, are in :mod:`kvsim.tools.study.presses`.
"""

from __future__ import annotations

import numpy as np

from kvsim.tools.study.model import Kept
from kvsim.tools.study.press_prefill import kept
from kvsim.tools.study.presses import PROTOCOL, make, ratio
from kvsim.tools.task.run import empty_caches, predict, protocol_rows


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
