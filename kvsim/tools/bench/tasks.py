"""``python -m kvsim bench --tasks``: the passkey task inside the model, against its floors.

On the first ``prompts`` depths of one length of a task file (default
``scenarios/passkey_smollm2.toml``), in one process, torch and NumPy's BLAS on one thread:

- the model's floor: one prefill of the prompt, then every protocol's decode steps (the
  question, where it joins after the compression, and the answer) with all of its
  ``policies x budgets`` caches full, batched as kvsim batches them: the model's own
  work, no policy's;
- kvsim's trial (:func:`kvsim.tools.task.trial.run_trial`): the full cache's answer, every
  policy x budget x protocol and the prediction, and its time per compressed run;
- where kvpress is importable, kvpress's pipeline (the press at prefill into a
  ``DynamicCache``, then the question and the greedy answer) for the file's policies that
  have a kvpress twin (:data:`kvsim.tools.task.parity.TWINS`), per run.

Ratios are of times measured in turn in this run; the load average is beside them.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

TASK = Path(__file__).resolve().parents[3] / "scenarios" / "passkey_smollm2.toml"


def floor_seconds(net, full, prompt, cfg, runs: int) -> float:
    """The decode of one trial with every cache full (``runs`` caches per protocol, each
    protocol's steps as :func:`kvsim.tools.task.run.answer` takes them) and the full
    cache's own answer; the prefill is not included."""
    from kvsim.protocols.question import plan
    from kvsim.tools.study.model import Decoder, FullCache, stores
    from kvsim.tools.task.run import decode_answers

    P, Q = prompt.ids.size, prompt.question_len
    L, H_kv = full.keys.shape[:2]
    start = time.perf_counter()
    for protocol, C in [(None, 1)] + [(p, runs) for p in sorted(cfg.compress)]:
        at = P if protocol is None else plan(protocol, P, Q, cfg.budgets[0],
                                             cfg.answer_tokens).compress_at
        keys, values = stores(full, C, at, P + cfg.answer_tokens, [], [])
        caches = [[[FullCache(at) for _ in range(H_kv)] for _ in range(L)] for _ in range(C)]
        decoder = Decoder(net, full, at, caches, keys, values, P + cfg.answer_tokens)
        logits = np.repeat(full.logits[-1:], C, axis=0)
        for i in range(P - at):
            out = decoder.step(logits=i == P - at - 1)
            logits = logits if out is None else out
        decode_answers(decoder, logits, cfg.answer_tokens)
    return time.perf_counter() - start


def kvpress_seconds(net, prompt, cfg) -> tuple[float, int]:
    """The seconds of kvpress's pipeline over every policy of ``cfg`` with a twin at every
    budget (the twin's required settings imposed), and how many runs that is."""
    from kvsim.scenario.load import PolicyConfig
    from kvsim.tools.task.parity import TWINS, kvpress_answer, twin_press
    from kvsim.tools.study.presses import make, ratio

    at = prompt.ids.size - prompt.question_len
    seconds, runs = 0.0, 0
    for pc in cfg.policies:
        if pc.kind not in TWINS:
            continue
        press = twin_press(PolicyConfig(pc.label, pc.kind,
                                        {**pc.params, **TWINS[pc.kind].needs}), cfg.seed)
        for b in cfg.budgets:
            seconds += kvpress_answer(net, make(press, ratio(at, b)), prompt,
                                      cfg.answer_tokens)[2]
            runs += 1
    return seconds, runs


def task_rows(path: Path = TASK, length: int | None = None, prompts: int = 2) -> dict:
    """The measurements above on ``prompts`` prompts of ``length`` tokens (default: the
    file's longest length)."""
    from kvsim.protocols.run import get_policy
    from kvsim.models.capture import load_model
    from kvsim.models.adapter import attach
    from kvsim.models.threads import one_thread
    from kvsim.tools.study.model import prefill
    from kvsim.tools.task import inputs
    from kvsim.tools.task.command import filler_ids, prompt_frame
    from kvsim.tools.task.config import load_config
    from kvsim.tools.task.kinds import require_passkey
    from kvsim.tools.task.trial import run_trial

    cfg = load_config(path)
    require_passkey(cfg, "bench --tasks times the passkey task")
    length = length or max(cfg.lengths)
    cfg = dataclasses.replace(cfg, lengths=(length,), trials=1)
    net, tokenizer = load_model(str(cfg.model), cfg.gguf_file)
    kvpress = importlib.util.find_spec("kvpress") is not None
    runs = len(cfg.policies) * len(cfg.budgets)
    rope = any("rope" in get_policy(pc.kind).needs for pc in cfg.policies)
    out: dict = {"file": str(path.name), "length": length, "runs_per_protocol": runs,
                 "protocols": list(cfg.compress), "answer_tokens": cfg.answer_tokens,
                 "prompts": [], "kvpress": kvpress}
    with one_thread():
        attach(net)
        text_ids = filler_ids(cfg, tokenizer)
        form = prompt_frame(cfg, tokenizer)
        for depth in cfg.depths[:prompts]:
            cell = (length, depth, 0)
            prompt = inputs.build(tokenizer, length, depth,
                                  inputs.trial_rng(cfg.seed, length, depth, 0), text_ids, form)
            start = time.perf_counter()
            full = prefill(net, prompt.ids, logits_to_keep=1, rope=rope)
            row = {"depth": depth, "prefill_s": time.perf_counter() - start}
            row["floor_s"] = row["prefill_s"] + floor_seconds(net, full, prompt, cfg, runs)
            start = time.perf_counter()
            run_trial(net, tokenizer, cfg, cell, text_ids, form)
            row["kvsim_trial_s"] = time.perf_counter() - start
            row["kvsim_per_run_s"] = row["kvsim_trial_s"] / (runs * len(cfg.compress))
            row["trial_over_floor"] = row["kvsim_trial_s"] / row["floor_s"]
            if kvpress:
                seconds, n = kvpress_seconds(net, prompt, cfg)
                row["kvpress_runs"] = n
                row["kvpress_per_run_s"] = seconds / n
                row["kvpress_over_kvsim_per_run"] = row["kvpress_per_run_s"] / \
                    row["kvsim_per_run_s"]
            row["load_1min"] = os.getloadavg()[0]
            out["prompts"].append(row)
            print(task_line(row))
    return out


def task_line(row: dict) -> str:
    """One printed line of a prompt's measurements."""
    line = (f"task depth {row['depth']}: floor {row['floor_s']:.2f} s (prefill "
            f"{row['prefill_s']:.2f} s), kvsim trial {row['kvsim_trial_s']:.2f} s = "
            f"x{row['trial_over_floor']:.2f} the floor, {row['kvsim_per_run_s']:.3f} s per "
            f"compressed run")
    if "kvpress_per_run_s" in row:
        line += (f"; kvpress {row['kvpress_per_run_s']:.3f} s per run "
                 f"(x{row['kvpress_over_kvsim_per_run']:.1f} kvsim's)")
    return line + f"; load {row['load_1min']:.2f}"


def run_tasks(out: Path, path: Path = TASK, prompts: int = 2) -> dict:
    """:func:`task_rows` of the task file ``path``, printed and written to
    ``out/bench_tasks.json``."""
    import json

    result = task_rows(Path(path), prompts=prompts)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "bench_tasks.json.tmp"
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, out / "bench_tasks.json")
    print(f"wrote {out / 'bench_tasks.json'}")
    return result
