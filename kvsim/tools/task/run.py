"""One passkey trial inside the model, every policy x budget x protocol, and its prediction.

Per trial (a length ``n``, a depth ``d``, a trial index):

1. The prompt (:mod:`~kvsim.tools.task.inputs`) runs once with full attention
   (:func:`~kvsim.tools.study.model.prefill`); its last logits give the first answer
   token of the full cache and of ``after_question`` (whose compression follows the prefill).
2. Per protocol (:mod:`kvsim.protocols.question`), every policy x budget is a
   :class:`~kvsim.protocols.stepping.Stepper` per layer and KV head, its prefill selection
   made from the full-cache attention of the queries before the compression point. That
   selection is the simulator's prediction, made without the model: whether each cache
   holds the key's digits when the answer starts, and how much of the question's
   full-cache attention falls on the digits it holds.
3. All caches of a protocol then decode together (one forward pass per step): the
   question's tokens (``before_question``, ``prefill_only``: they join without eviction),
   then the greedy answer, each generated token joining under the policy as at decode
   (``prefill_only``: without eviction, kvpress's protocol). ``decode_recall``'s prompt
   ends with a first task instead (the protocols' question): each cache first generates
   ``generate_tokens`` tokens of its own, then the recall question is teacher-forced and
   the answer generated, every one of these tokens joining as the answer's do
   (:func:`respond`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvsim.protocols.question import plan
from kvsim.tools.study.grid import grid_stepper, layer_wide, needing, query_runs
from kvsim.tools.study.model import Decoder, FullCache, FullRun, prefill, query_stores, stores
from kvsim.tools.task import inputs, kinds
from kvsim.tools.task.config import TaskConfig

FULL = "full"


def cells(cfg: TaskConfig) -> list[tuple[int, float, int]]:
    """Every (length, depth, trial) of the grid, in report order."""
    return [(n, d, i) for n in cfg.lengths for d in cfg.depths for i in range(cfg.trials)]


def decode_answers(decoder: Decoder, logits: np.ndarray, steps: int) -> tuple[np.ndarray,
                                                                                np.ndarray]:
    """Greedy answers of ``steps`` tokens, the first from ``logits`` (C, V); each token then
    joins every cache (one decoder step) to give the next. Returns the (C, steps) tokens
    and each cache's peak size over the steps."""
    C = logits.shape[0]
    tokens = np.zeros((C, steps), np.int64)
    tokens[:, 0] = logits.argmax(axis=-1)
    peak = decoder.sizes.max(axis=1) if decoder.t > decoder.P else np.zeros(C, np.int64)
    for s in range(1, steps):
        logits = decoder.step(tokens[:, s - 1])
        peak = np.maximum(peak, decoder.sizes.max(axis=1))
        tokens[:, s] = logits.argmax(axis=-1)
    return tokens, peak


def respond(decoder: Decoder, logits: np.ndarray, steps: int, generate: int = 0,
            recall: tuple[int, ...] = (), at_recall=None) -> tuple[np.ndarray, np.ndarray,
                                                                   np.ndarray]:
    """:func:`decode_answers` of ``steps`` tokens; with ``generate`` (decode_recall), first
    each cache's own ``generate`` greedy tokens from ``logits``, then the ``recall``
    question's ids, the same in every cache, and the answer from its last logits
    (``at_recall()`` is called as the question starts). Returns the (C, steps) answer
    tokens, the (C, generate) generated ones and each cache's peak size over the steps."""
    C = logits.shape[0]
    if not generate:
        tokens, peak = decode_answers(decoder, logits, steps)
        return tokens, np.zeros((C, 0), np.int64), peak
    generated, peak = decode_answers(decoder, logits, generate)
    decoder.step(generated[:, -1], logits=False)  # the last generated token joins
    peak = np.maximum(peak, decoder.sizes.max(axis=1))
    if at_recall is not None:
        at_recall()
    for i, token in enumerate(recall):  # only the question's last logits are read
        logits = decoder.step(np.full(C, token), logits=i == len(recall) - 1)
        peak = np.maximum(peak, decoder.sizes.max(axis=1))
    tokens, answer_peak = decode_answers(decoder, logits, steps)
    return tokens, generated, np.maximum(peak, answer_peak)


def tail(cfg: TaskConfig, prompt: inputs.Prompt) -> int:
    """The tokens that join after the prompt: the answer's (decode_recall: after the
    generated ones and the recall question)."""
    return cfg.generate_tokens + len(prompt.recall) + cfg.answer_tokens


def recall_columns(generated: np.ndarray, held: float) -> dict:
    """decode_recall's columns of a row before scoring (none for other kinds): the cache's
    ``generated`` tokens and the share ``held`` of its caches holding the needle when the
    recall question starts."""
    return {"recall_retention": held, "generated": generated} if generated.size else {}


def question_rows(prompt: inputs.Prompt, attention: np.ndarray) -> np.ndarray:
    """(P,) the question queries' full-cache attention per key, summed over the question's
    queries and averaged over the group's query heads."""
    P, Q = prompt.ids.size, prompt.question_len
    return attention[:, P - Q:P].sum(axis=1).mean(axis=0)


def _kept(cache: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Which of ``positions`` the kept positions ``cache`` hold (``np.isin``'s mask, by a
    membership table: no sort per cache)."""
    top = int(positions.max())
    inside = np.zeros(top + 1, bool)
    inside[cache[cache <= top]] = True
    return inside[positions]


def _holds(cache: np.ndarray, digits: tuple[np.ndarray, ...], every: bool) -> bool:
    held = [bool(_kept(cache, d).all()) for d in digits]
    return all(held) if every else any(held)


def predict(caches: Caches, at: tuple[int, int, int], cache: np.ndarray,
            digits: tuple[np.ndarray, ...], on_digits: np.ndarray, every: bool = False) -> None:
    """Record what one cache's kept positions ``cache`` predict at ``at`` = (run, global
    layer, KV head): whether it holds the key's digits (one of the spans of ``digits``;
    ``every``: all of them, a task kind's needed values), their share, their question mass
    (``on_digits``: the question's attention on each digit token)."""
    kept = _kept(cache, np.concatenate(digits))
    caches.held[at] = _holds(cache, digits, every)
    caches.share[at] = kept.mean()
    caches.mass[at] = on_digits[kept].sum()


@dataclass
class Caches:
    """Every policy x budget of one protocol on one prompt, compressed and ready to decode.

    ``steppers[c][layer][kv_head]``; ``keys``/``values``: their stores; ``at``: the
    compression point; ``question``: the question tokens that join after it (teacher-forced);
    ``free``: the tokens that join without eviction (the question; under ``prefill_only``
    the answer too);
    ``budgets[c]``: each cache's decode budget (its peak); ``held``, ``share``, ``mass``
    (C, L, H_kv): the prediction, from the selections alone; ``queries``: the query
    stores of the caches whose policy reads query vectors. decode_recall: ``generate``
    tokens, then the ``recall`` question; ``spans``/``every``: the needed spans (the
    prompt's ``digits``, :func:`predict`); :func:`answer` fills ``recall_held`` (C, L,
    H_kv: whether each cache holds them when the question starts) and ``generated``.
    """

    runs: list
    steppers: list
    keys: np.ndarray
    values: np.ndarray
    at: int
    question: int
    free: int
    budgets: np.ndarray
    held: np.ndarray
    share: np.ndarray
    mass: np.ndarray
    queries: dict = field(default_factory=dict)
    generate: int = 0
    recall: tuple = ()
    spans: tuple = ()
    every: bool = False
    recall_held: np.ndarray | None = None
    generated: np.ndarray | None = None


def empty_caches(full: FullRun, prompt: inputs.Prompt, cfg: TaskConfig, protocol: str,
                 configs=None) -> Caches:
    """The stores and result arrays of every policy x budget under ``protocol``, before
    any selection; ``configs``: other policies than ``cfg``'s (kvpress's presses, which
    keep no vectors of their own)."""
    P, Q = prompt.ids.size, prompt.question_len
    own = configs is None
    runs = [(pc, b) for pc in (cfg.policies if own else configs) for b in cfg.budgets]
    after = tail(cfg, prompt)
    plans = [plan(protocol, P, Q, b, after) for _, b in runs]
    at = plans[0].compress_at
    capacity = P + after
    keys, values = stores(full, len(runs), at, capacity,
                          needing(runs, "keys") if own else [],
                          needing(runs, "values") if own else [])
    L, H_kv = full.keys.shape[:2]
    shape = (len(runs), len(full.global_layers), H_kv)
    return Caches(runs, [[[None] * H_kv for _ in range(L)] for _ in runs], keys, values, at,
                  P - at, plans[0].free, np.array([p.budget for p in plans]), np.zeros(shape),
                  np.zeros(shape), np.zeros(shape),
                  query_stores(full, query_runs(runs), at, capacity) if own else {},
                  cfg.generate_tokens, prompt.recall, prompt.digits, prompt.needs_all)


def compress(full: FullRun, prompt: inputs.Prompt, cfg: TaskConfig) -> tuple[dict, dict]:
    """The compressed caches of every policy x budget under each protocol of ``cfg``
    (protocol -> :class:`Caches`; the full-cache attention of the queries before each
    compression point decides, no model runs here), what they predict, and per (global
    layer, KV head) the question's full-cache attention per prompt key.

    The prompt's attention is computed once per KV head: a protocol that compresses before
    the question reads its first rows and columns (causal rows before a point attend only
    to keys before it)."""
    P = prompt.ids.size
    protocols = {protocol: empty_caches(full, prompt, cfg, protocol)
                 for protocol in sorted(cfg.compress) if cfg.policies}  # none: presses only
    _, H_kv = full.keys.shape[:2]
    digits = np.concatenate(prompt.digits)
    rows_of: dict = {}
    layered = any(layer_wide(pc) for pc in cfg.policies)
    layers: dict = {}  # runs stepped a layer at a time: protocol -> (run, layer[, KV head]) -> layer
    for i, layer in enumerate(full.global_layers):  # a sliding-window layer: no policy
        stack = full.layer_attention(layer, P) if layered else None
        stacks = {at: _until(stack, at) for at in {c.at for c in protocols.values()}} \
            if layered else {}  # each protocol's compression point: the layer's rows
        layer_passes: dict = {at: {} for at in stacks}  # and their memos
        for j in range(H_kv):
            whole = stack[j] if layered else full.prompt_attention(layer, j, P)
            rows_of[layer, j] = question_rows(prompt, whole)
            on_digits = rows_of[layer, j][digits]
            for protocol, caches in protocols.items():
                attention = stacks[caches.at][j] if layered else _until(whole, caches.at)
                passes: dict = {}  # the column sums of ``attention``, computed once for all
                for c, (pc, b) in enumerate(caches.runs):
                    wide = layer_wide(pc)
                    s = grid_stepper(full, pc, b, c, layer, j, attention, caches.at,
                                     caches.keys, caches.values, caches.queries, cfg.gqa,
                                     cfg.seed, P + tail(cfg, prompt),
                                     layer_passes[caches.at] if wide else passes,
                                     stacks.get(caches.at), layers.setdefault(protocol, {}))
                    predict(caches, (c, i, j), s.cache, prompt.digits, on_digits,
                            prompt.needs_all)
                    if caches.free:
                        s.widen(caches.free)
                    caches.steppers[c][layer][j] = s
    return protocols, rows_of


def _until(attention: np.ndarray, at: int) -> np.ndarray:
    """The causal ``attention`` (..., P, P) of the queries and keys before ``at``
    (contiguous; itself when ``at = P``)."""
    return attention if at == attention.shape[-1] else \
        np.ascontiguousarray(attention[..., :at, :at])


def answer(net, full: FullRun, caches: Caches, answer_tokens: int) -> tuple[np.ndarray,
                                                                            np.ndarray]:
    """Decode the question (if it joins after the compression) and the greedy answers of
    every cache together; returns the (C, answer_tokens) tokens and each cache's peak."""
    C = len(caches.runs)
    decoder = Decoder(net, full, caches.at, caches.steppers, caches.keys, caches.values,
                      int(caches.budgets.max()), caches.queries)
    logits = np.repeat(full.logits[-1:], C, axis=0)
    peak = np.zeros(C, np.int64)
    for i in range(caches.question):  # the question, teacher-forced, joining without eviction
        if i < caches.question - 1:  # only its last token's logits are read
            decoder.step(logits=False)
        else:
            logits = decoder.step()
        peak = np.maximum(peak, decoder.sizes.max(axis=1))
    shape = (C, len(full.global_layers), len(caches.steppers[0][0]))

    def at_recall() -> None:  # decode_recall: which caches still hold the needle
        caches.recall_held = np.array([[[_holds(caches.steppers[c][layer][j].cache,
                                                caches.spans, caches.every)
                                         for j in range(shape[2])]
                                        for layer in full.global_layers] for c in range(C)],
                                      float).reshape(shape)

    tokens, caches.generated, answer_peak = respond(decoder, logits, answer_tokens,
                                                    caches.generate, caches.recall, at_recall)
    peak = np.maximum(peak, answer_peak)
    if (peak > caches.budgets).any():
        raise AssertionError("a cache exceeded its budget")
    return tokens, peak


def protocol_rows(net, full: FullRun, caches: Caches, protocol: str, answer_tokens: int
                  ) -> list[dict]:
    """Every policy x budget of one protocol: prediction and answer."""
    tokens, peak = answer(net, full, caches, answer_tokens)
    return [{"policy": pc.label, "kind": pc.kind, "budget": b, "protocol": protocol,
             "peak_cache": int(peak[c]), "tokens": tokens[c],
             "retention": float(caches.held[c].mean()),
             "digit_share": float(caches.share[c].mean()),
             "kept_needle_mass": float(caches.mass[c].mean()),
             "late_needle_mass": float(caches.mass[c, late_layers(caches.mass.shape[1]):].mean()),
             **recall_columns(caches.generated[c], float(caches.recall_held[c].mean())
                              if caches.generate else 1.0)}
            for c, (pc, b) in enumerate(caches.runs)]


def late_layers(n: int) -> int:
    """The first of the late global layers (the second half of ``n``), whose question
    attention on the kept needle is the ``late_needle_mass`` predictor."""
    return n // 2


def full_trial(net, tokenizer, cfg: TaskConfig, cell: tuple[int, float, int],
               text_ids: np.ndarray | None, form: inputs.Frame, rope: bool = False):
    """The prompt of one trial, its full prefill, the full cache's greedy answer
    (``answer_tokens`` ids) and its generated tokens (decode_recall's; else none);
    ``form``: the model's prompt frame (:func:`~kvsim.tools.task.inputs.frame`)."""
    prompt = trial_prompt(tokenizer, cfg, cell, text_ids, form)
    full = prefill(net, prompt.ids, logits_to_keep=1, rope=rope)
    P = prompt.ids.size
    L, H_kv = full.keys.shape[:2]
    T = P + tail(cfg, prompt)
    keys, values = stores(full, 1, P, T, [], [])
    reference = Decoder(net, full, P, [[[FullCache(P) for _ in range(H_kv)] for _ in range(L)]],
                        keys, values, T)
    tokens, generated, _ = respond(reference, full.logits[-1:], cfg.answer_tokens,
                                   cfg.generate_tokens, prompt.recall)
    return prompt, full, tokens[0], generated[0]


def trial_prompt(tokenizer, cfg: TaskConfig, cell: tuple[int, float, int],
                 text_ids: np.ndarray | None, form: inputs.Frame) -> inputs.Prompt:
    """The prompt of one trial of ``cfg``'s kind: the passkey's in the model's ``form``, or
    a RULER kind's (:mod:`~kvsim.tools.task.kinds`) in the format of ``task.prompt``."""
    length, depth, trial = cell
    rng = inputs.trial_rng(cfg.seed, length, depth, trial)
    if cfg.kind == kinds.PASSKEY:
        return inputs.build(tokenizer, length, depth, rng, text_ids, form)
    return kinds.build(cfg.kind, tokenizer, length, depth, rng, text_ids, cfg.prompt)


def end_ids(net, tokenizer) -> frozenset[int]:
    """The ids that end the model's answer, those its own ``generate()`` stops at: its
    generation config's ``eos_token_id`` (one id or a list) and the tokenizer's EOS."""
    config = getattr(net.generation_config, "eos_token_id", None)
    ids = set(config if isinstance(config, (list, tuple)) else [config])
    ids.add(getattr(tokenizer, "eos_token_id", None))  # a tokenizer may have none
    return frozenset(int(i) for i in ids if i is not None)


def until_end(tokens: np.ndarray, ends: frozenset[int]) -> np.ndarray:
    """``tokens`` up to, not including, the first of ``ends`` (all of them if none)."""
    at = np.flatnonzero(np.isin(tokens, list(ends)))
    return tokens[:at[0]] if at.size else tokens


def scored(tokenizer, prompt: inputs.Prompt, cell: tuple[int, float, int], row: dict, *,
           ends: frozenset[int]) -> dict:
    """A result row of ``cell``: the trial's columns, ``row`` (its ``tokens`` up to the
    first end token ``ends`` (:func:`end_ids`) decoded into the answer) and the success (a
    task kind's: RULER's scores beside it, the kind's metric giving 1). What a cache
    writes after the model ends its answer is not scored: RULER's harness stops there."""
    row = dict(row)
    answer = tokenizer.decode(until_end(row.pop("tokens"), ends).tolist())
    recall = {}
    if "generated" in row:  # decode_recall: does the generated text repeat a value?
        echo = kinds.string_match_part(tokenizer.decode(row.pop("generated").tolist()),
                                       prompt.expected)
        recall = {"recall_retention": row.pop("recall_retention"), "echo": int(echo)}
    head = {"length": cell[0], "depth": cell[1], "trial": cell[2], "key": prompt.key,
            "needle_start": prompt.needle_start, "actual_depth": round(prompt.depth, 4),
            "question_len": prompt.question_len, **row, "answer": answer}
    if prompt.needs_all:
        return {**head, "number": "", **kinds.score(prompt.kind, answer, prompt.expected),
                **recall}
    number = inputs.first_number(answer)
    return {**head, "number": number or "", "success": int(number == prompt.key)}


def gate_trial(net, tokenizer, cfg: TaskConfig, cell: tuple[int, float, int],
               text_ids: np.ndarray | None, form: inputs.Frame) -> list[dict]:
    """The full cache's row of one trial alone (``kvsim task --gate``)."""
    prompt, _, tokens, generated = full_trial(net, tokenizer, cfg, cell, text_ids, form)
    return [scored(tokenizer, prompt, cell, {"policy": FULL, "tokens": tokens,
                                             **recall_columns(generated, 1.0)},
                   ends=end_ids(net, tokenizer))]
