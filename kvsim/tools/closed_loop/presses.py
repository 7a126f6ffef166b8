"""kvpress's presses in ``kvsim closed-loop`` (the optional extra ``kvpress``).

A ``[policies.NAME]`` table with a ``press`` key is a kvpress press, read and checked as in
a task file (:mod:`kvsim.tools.study.presses`), and runs under kvpress's own protocol: per
budget ``B``, the press compresses the prompt (its ``P`` tokens) once, in kvpress's own
prefill, at the ``compression_ratio`` that keeps exactly ``B`` keys per layer and KV head;
the positions it kept are read back from its cache (:func:`press_runs`), and the text's
decode tokens then join them with no eviction (a :class:`~kvsim.tools.study.model.Kept`
cache per global layer and KV head, which grows by one key per step: ``B + t - P + 1`` at
step ``t``). Its open loop (:func:`open_loop`) is the same cache read on the full run's
attention: the mass the full-cache rows put on it and the output error of renormalising
them over it, as the simulator measures its policies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvsim.scenario.reader import PolicyConfig
from kvsim.tools.study.model import FullRun, Kept
from kvsim.tools.study.press_prefill import kept
from kvsim.tools.study.presses import make, ratio


@dataclass(frozen=True)
class PressRun:
    """One press at one budget: its table (``config``: the press's class as ``kind``) and
    the context positions its prefill kept, (H_kv, B) per global layer (``held``)."""

    config: PolicyConfig
    held: dict

    @property
    def label(self) -> str:
        return self.config.label

    @property
    def kind(self) -> str:
        return self.config.kind

    def cache(self, layer: int, kv_head: int) -> Kept:
        """The decode cache of one global layer and KV head: the kept positions, then every
        decode token without eviction."""
        return Kept(self.held[layer][kv_head].tolist())


def press_runs(net, full: FullRun, presses, budgets, prompt_len: int
               ) -> list[tuple[PressRun, int]]:
    """(run, budget) for every press of ``presses`` x budget: kvpress's prefill of the
    prompt under the press at the ratio that keeps the budget, and the positions it kept."""
    ids = full.token_ids[:prompt_len]
    context_keys = full.keys[:, :, :prompt_len]
    return [(PressRun(pc, kept(net, make(pc, ratio(prompt_len, b)), ids, context_keys,
                               full.global_layers)), b)
            for pc in presses for b in budgets]


def open_loop(full: FullRun, prompt_len: int, run: PressRun) -> tuple[np.ndarray, np.ndarray]:
    """(mass, relative output error), each (global layers, H, steps): the full run's
    attention of each decode query ``t`` restricted to the press's cache (its kept positions
    and ``P .. t``), as :mod:`kvsim.tools.closed_loop.open_loop` measures a policy: the
    mass on the cache and ``|o~ - o| / |o|``, ``o~`` the output renormalised over it."""
    L, H, T, _ = full.queries.shape
    H_kv, G, P = full.keys.shape[1], full.group, prompt_len
    layers = full.global_layers
    mass, error = np.zeros((len(layers), H, T - P)), np.zeros((len(layers), H, T - P))
    decode = np.arange(T)[None, :] >= P  # (1, T): the decode tokens, all kept
    future = np.arange(T)[None, :] > np.arange(P, T)[:, None]  # (steps, T): after query t
    for i, layer in enumerate(layers):
        g = full.geometry[layer]
        for j in range(H_kv):
            q = full.queries[layer, j * G:(j + 1) * G, P:].astype(np.float64)
            k = full.keys[layer, j].astype(np.float64)
            v = full.values[layer, j].astype(np.float64)
            logits = (q @ k.T) * g.scaling  # (G, steps, T)
            if g.softcap:
                logits = g.softcap * np.tanh(logits / g.softcap)
            logits[:, future] = -np.inf
            rows = np.exp(logits - logits.max(axis=-1, keepdims=True))
            rows /= rows.sum(axis=-1, keepdims=True)
            inside = decode.copy()
            inside[0, run.held[layer][j]] = True
            on_cache = rows * inside
            m = on_cache.sum(axis=-1)
            o = rows @ v
            o_cache = (on_cache @ v) / np.where(m > 0, m, 1.0)[..., None]
            norm = np.linalg.norm(o, axis=-1)
            mass[i, j * G:(j + 1) * G] = m
            error[i, j * G:(j + 1) * G] = np.where(
                norm > 0, np.linalg.norm(o_cache - o, axis=-1) / np.where(norm > 0, norm, 1.0),
                0.0)
    return mass, error
