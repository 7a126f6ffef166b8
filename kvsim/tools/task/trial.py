"""One passkey trial, whole: the full cache's answer, every protocol's policies x budgets
(:mod:`kvsim.tools.task.run`), kvpress's presses where the file has any
(:mod:`kvsim.tools.task.press_runs`), and the question's attention on the needle."""

from __future__ import annotations

import numpy as np

from kvsim.protocols.run import get_policy
from kvsim.tools.task import inputs
from kvsim.tools.task.config import TaskConfig
from kvsim.tools.task.press_runs import press_rows
from kvsim.tools.task.run import (FULL, compress, end_ids, full_trial, late_layers,
                                  protocol_rows, recall_columns, scored, tail)


def run_trial(net, tokenizer, cfg: TaskConfig, cell: tuple[int, float, int],
              text_ids: np.ndarray | None, form: inputs.Frame) -> list[dict]:
    """Every row of one trial: the full cache, then each protocol's policies x budgets."""
    prompt, full, tokens, generated = full_trial(
        net, tokenizer, cfg, cell, text_ids, form,
        rope=any("rope" in get_policy(pc.kind).needs for pc in cfg.policies))
    P = prompt.ids.size
    H_kv = full.keys.shape[1]
    digits = np.concatenate(prompt.digits)
    protocols, rows_of = compress(full, prompt, cfg)
    rows = []
    for protocol, caches in protocols.items():
        rows += protocol_rows(net, full, caches, protocol, cfg.answer_tokens)
        protocols[protocol] = None  # its stores go before the next protocol decodes
    if cfg.presses:  # kvpress's presses, under its protocol
        rows += press_rows(net, full, prompt, cfg, rows_of)
    on_needle = np.array([[rows_of[layer, j][digits].sum() for j in range(H_kv)]
                          for layer in full.global_layers])
    question_mass = float(on_needle.mean())
    rows.insert(0, {"policy": FULL, "kind": FULL, "budget": P, "protocol": FULL,
                    "peak_cache": P + tail(cfg, prompt) - 1, "tokens": tokens,
                    "retention": 1.0, "digit_share": 1.0, "kept_needle_mass": question_mass,
                    "late_needle_mass": float(on_needle[late_layers(len(on_needle)):].mean()),
                    **recall_columns(generated, 1.0)})
    ends = end_ids(net, tokenizer)
    return [{**scored(tokenizer, prompt, cell, r, ends=ends),
             "question_needle_mass": question_mass} for r in rows]
