"""``kvsim closed-loop``: every policy and budget inside the model, beside the open loop.

1. The text runs once with the full cache (:func:`~kvsim.tools.study.model.prefill`).
2. The simulator runs every policy and budget on the full run's attention (open loop).
3. Every policy and budget decodes the text inside the model under its own caches, one
   :class:`~kvsim.protocols.stepping.Stepper` per layer and KV head (closed loop), with the
   full cache decoded the same way as the numerical reference.
4. kvpress's presses, where the file names any, compress the prompt once in kvpress's own
   prefill and decode with no eviction (:mod:`kvsim.tools.closed_loop.presses`).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from kvsim.errors import KvsimError
from kvsim.protocols.run import get_policy
from kvsim.models import catalog
from kvsim.tools.closed_loop import metrics
from kvsim.paths import read_text
from kvsim.tools.closed_loop.config import ClosedLoopConfig
from kvsim.models.adapter import attach
from kvsim.tools.study.grid import grid_stepper, layer_wide, query_runs
from kvsim.tools.study.model import Decoder, FullCache, FullRun, prefill, query_stores, stores
from kvsim.tools.study.job import FORKED, tick
from kvsim.tools.study.workers import study_map
from kvsim.tools.closed_loop.open_loop import open_loop
from kvsim.tools.closed_loop.presses import PressRun, press_runs
from kvsim.tools.closed_loop.presses import open_loop as press_open_loop
from kvsim.numerics.quantize import Quantize
from kvsim.scenario.reader import PolicyConfig

FULL = "full"  # label of the full-cache reference run


@dataclass
class Series:
    """Per decode step of one run: closed-loop ``kl`` and ``nll``, open-loop ``mass``."""

    label: str
    kind: str
    budget: int
    kl: np.ndarray
    nll: np.ndarray
    mass: np.ndarray
    open: dict = field(default_factory=dict)  # open-loop predictors (metrics.open_metrics)


def load_text(cfg: ClosedLoopConfig, tokenizer) -> np.ndarray:
    """The first ``tokens`` token ids of the text."""
    try:
        raw = read_text(cfg.text)
    except ValueError as exc:
        raise KvsimError(f"closed_loop.text: expected a readable UTF-8 text file ({exc})") \
            from None
    ids = np.asarray(tokenizer(raw)["input_ids"], np.int64)
    if ids.size < cfg.tokens:
        raise KvsimError(f"closed_loop.tokens: expected at most the text's {ids.size} "
                         f"tokens, got {cfg.tokens}")
    return ids[:cfg.tokens]


def make_steppers(full: FullRun, runs: list[tuple[PolicyConfig, int]], prompt_len: int,
                  keys: np.ndarray, values: np.ndarray, gqa: str, seed: int,
                  queries: dict | None = None) -> list:
    """``steppers[c][layer][kv_head]`` for each (policy, budget) of ``runs`` (None: the full
    cache; a :class:`~kvsim.tools.closed_loop.presses.PressRun`: what a press kept, then no
    eviction) on every global layer; None on a sliding-window layer (its window is its
    cache). ``queries``: the query stores of the runs that read them (:func:`query_runs`)."""
    queries = queries or {}
    L, _, H_kv, T, _ = keys.shape
    out: list = [[[None] * H_kv for _ in range(L)] for _ in runs]
    stepped = [cfg for cfg, _ in runs if isinstance(cfg, PolicyConfig) and cfg.kind != FULL]
    layered = any(layer_wide(cfg) for cfg in stepped)
    layers: dict = {}  # runs stepped a layer at a time: (run, layer[, KV head]) -> its layer
    for layer in full.global_layers:
        stack = full.layer_attention(layer, prompt_len) if layered else None
        for j in range(H_kv):
            prompt = stack[j] if layered else full.prompt_attention(layer, j, prompt_len) \
                if stepped else None
            for c, (cfg, budget) in enumerate(runs):
                if cfg is None or cfg.kind == FULL:  # the reference, or a full KIVI cache
                    out[c][layer][j] = FullCache(prompt_len)
                elif isinstance(cfg, PressRun):
                    out[c][layer][j] = cfg.cache(layer, j)
                else:
                    out[c][layer][j] = grid_stepper(full, cfg, budget, c, layer, j, prompt,
                                                    prompt_len, keys, values, queries, gqa,
                                                    seed, T, stack=stack, layers=layers)
    return out


def closed_loop(net, full: FullRun, runs: list[tuple[PolicyConfig | None, int]],
                prompt_len: int, gqa: str, seed: int, tick=None,
                quantize: Quantize | None = None) -> list[tuple]:
    """(kl, nll) per decode step for each run, all decoded together (one forward per step);
    ``tick(n)`` is called after each step with the number of runs. With ``quantize``, every
    run but the reference (``None``) stores its cache by KIVI."""
    T = full.T
    keys, values = stores(full, len(runs), prompt_len)
    queries = query_stores(full, query_runs(runs), prompt_len)
    steppers = make_steppers(full, runs, prompt_len, keys, values, gqa, seed, queries)
    width = max(T if cfg is None else budget + (T - prompt_len if isinstance(cfg, PressRun)
                                                else 0) for cfg, budget in runs)
    decoder = Decoder(net, full, prompt_len, steppers, keys, values, width, queries,
                      [None if cfg is None else quantize for cfg, _ in runs])
    steps = T - prompt_len
    kl, nll = np.zeros((len(runs), steps)), np.zeros((len(runs), steps))
    for s, t in enumerate(range(prompt_len, T)):
        logits = decoder.step()
        target = int(full.token_ids[t + 1]) if t + 1 < T else None
        kl[:, s], nll[:, s] = metrics.kl_nll(metrics.log_softmax(full.logits[t]), logits,
                                             target)
        if tick is not None:
            tick(len(runs))
    return [(kl[c], nll[c]) for c in range(len(runs))]


def _worker(members: list[int]) -> list[tuple]:
    net, full, runs, P, gqa, seed, quantize = FORKED["job"]
    return closed_loop(net, full, [runs[c] for c in members], P, gqa, seed, tick, quantize)


def _open_worker(pc: PolicyConfig) -> dict:
    full, cfg = FORKED["job"]
    return open_loop(full, cfg.prompt_len, pc.kind, pc.params, list(cfg.budgets), cfg.gqa,
                     cfg.quantize, cfg.seed)


def open_loops(full: FullRun, cfg: ClosedLoopConfig, workers: int, progress: bool) -> list:
    """The simulator's open loop of every policy of ``cfg`` (on ``workers`` processes)."""
    with tqdm(total=len(cfg.policies), desc="open loop (policies)",
              disable=not progress) as bar:
        return study_map(_open_worker, cfg.policies, workers, (full, cfg), bar)


def decode_batches(net, full: FullRun, runs: list, batches: list[list[int]], P: int, gqa: str,
                   seed: int, workers: int, bar,
                   quantize: Quantize | None = None) -> dict[int, tuple]:
    """(kl, nll) of every run, batch by batch, on ``workers`` forked processes (or the
    study's cluster, :func:`~kvsim.tools.study.workers.study_map`).

    A run's numbers depend on its batch (one forward pass per step for the whole batch),
    never on which process decodes it: results do not depend on ``workers``.
    """
    done = study_map(_worker, batches, workers, (net, full, runs, P, gqa, seed, quantize), bar,
                     weight=lambda members: len(members) * (full.T - P))
    return {c: res for members, out in zip(batches, done) for c, res in zip(members, out)}


def check_head_dims(full: FullRun, quant: Quantize) -> None:
    """A one-line error unless the quantisation group divides the model's key and value
    dimensions."""
    for what, d in (("key", full.keys.shape[-1]), ("value", full.values.shape[-1])):
        if d % quant.group:
            raise KvsimError(f"closed_loop.quantize.group: expected a divisor of the model's "
                             f"{what} dimension {d}, got {quant.group}")


def run(cfg: ClosedLoopConfig, net, tokenizer, progress: bool = True,
        workers: int = 1) -> tuple[list[Series], dict]:
    """Every policy and budget of ``cfg`` in the closed and the open loop (the closed-loop
    batches on ``workers`` forked processes).

    Returns the per-run series (the full-cache reference first) and facts for the report.
    """
    from kvsim.models.threads import one_thread

    start = time.perf_counter()
    with one_thread():  # results then do not depend on the machine's core count
        attach(net)
        ids = load_text(cfg, tokenizer)
        full = prefill(net, ids, rope=any("rope" in get_policy(pc.kind).needs
                                          for pc in cfg.policies))
        P, T = cfg.prompt_len, cfg.tokens
        # policies compress the global layers only: the open loop and its weights are theirs
        weights = metrics.layer_weights(full.attn_out_norm[full.global_layers], P)
        whole = np.ones((len(full.global_layers), full.queries.shape[1], T - P))
        series = [Series(FULL, FULL, T, None, None, whole.mean(axis=(0, 1)),
                         metrics.open_metrics(whole, 0.0 * whole, weights))]
        runs: list[tuple[PolicyConfig | None, int]] = [(None, T)]
        if cfg.quantize is not None:  # every token kept, stored by KIVI
            check_head_dims(full, cfg.quantize)
            kivi = PolicyConfig(f"{FULL}_kivi{cfg.quantize.bits}", FULL, {})
            ol = open_loop(full, P, FULL, {}, [T], cfg.gqa, cfg.quantize)[T]
            series.append(Series(kivi.label, FULL, T, None, None, ol.mass.mean(axis=(0, 1)),
                                 metrics.open_metrics(ol.mass, ol.error, weights)))
            runs.append((kivi, T))
        for pc, ol in zip(cfg.policies, open_loops(full, cfg, workers, progress)):
            for b in cfg.budgets:
                series.append(Series(pc.label, pc.kind, b, None, None,
                                     ol[b].mass.mean(axis=(0, 1)),
                                     metrics.open_metrics(ol[b].mass, ol[b].error, weights)))
                runs.append((pc, b))
        for press, b in press_runs(net, full, cfg.presses, cfg.budgets, P):
            mass, error = press_open_loop(full, P, press)
            series.append(Series(press.label, press.kind, b, None, None,
                                 mass.mean(axis=(0, 1)),
                                 metrics.open_metrics(mass, error, weights)))
            runs.append((press, b))
        # the full cache alone (it attends over every position), then the others by budget,
        # so that a batch gathers about as many keys as its caches hold
        order = [0] + sorted(range(1, len(runs)), key=lambda c: runs[c][1])
        batch = cfg.batch or len(runs) - 1
        batches = [order[:1]] + [order[lo:lo + batch] for lo in range(1, len(order), batch)]
        with tqdm(total=len(runs) * (T - P), unit="step", disable=not progress,
                  desc="closed loop (runs x steps)") as bar:
            done = decode_batches(net, full, runs, batches, P, cfg.gqa, cfg.seed, workers, bar,
                                  cfg.quantize)
        for c, (kl, nll) in done.items():
            series[c].kl, series[c].nll = kl, nll
    facts = {"wall_seconds": time.perf_counter() - start, "layers": int(full.keys.shape[0]),
             "global_layers": full.global_layers, "licence": catalog.licence(cfg.gguf_file),
             "windows": sorted({g.window for g in full.geometry if g.window}),
             "text_sha256": hashlib.sha256(cfg.text.read_bytes()).hexdigest(),
             "token_ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
             "heads": int(full.queries.shape[1]), "kv_heads": int(full.keys.shape[1]),
             "layer_weights": weights.tolist(), "token_ids": ids}
    return series, facts
