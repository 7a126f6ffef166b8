"""Parity of kvsim's policies with their kvpress twins, trial by trial, inside a real model.

``python -m kvsim.tools.task.parity FILE.toml --out DIR`` runs a task file's grid (its
prompts, lengths, depths, trials, budgets) under ``prefill_only``, kvpress's protocol. Per
trial and budget, each kvsim policy of the file runs as ``kvsim task`` runs it and its
kvpress twin (:data:`TWINS`, parameters matched) runs in kvpress's own pipeline (the press
compresses the context in an eager prefill into a ``DynamicCache``, then the question and a
greedy answer join with no eviction). Per run it records whether the kept positions of every
global layer and KV head are equal (:func:`kept_sets`; where not, the first layer, head and
positions that differ) and whether the answers are the same tokens. Where kvsim's rule
differs from kvpress's on purpose (:attr:`Twin.rule`), kvsim's selection with the difference
switched to kvpress's behaviour (:attr:`Twin.compatible`) is compared too, its answer decoded
by kvsim's decoder. One run of each side is timed on the first prompt of the grid. The folder
gets ``report.md`` and ``results.csv`` (one row per run).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kvsim.errors import KvsimError
from kvsim.scenario.load import PolicyConfig
from kvsim.tools.study.job import FORKED
from kvsim.tools.study.workers import forked_map
from kvsim.tools.task.kinds import require_passkey


def tova_all_heads(full, at: int, budget: int, layer: int) -> np.ndarray:
    """kvpress's TOVA at prefill, from kvsim's full-cache attention: the last context
    query's attention averaged over every query head of the layer (one set for all KV
    heads), the top ``budget - 1`` keys before it (stable ties) and the last position."""
    H_kv = full.keys.shape[1]
    last = np.concatenate([full.prompt_attention(layer, j, at)[:, -1, :at - 1]
                           for j in range(H_kv)]).mean(axis=0)
    kept = sorted([*np.argsort(-last, kind="stable")[:budget - 1].tolist(), at - 1])
    return np.array([kept] * H_kv, np.int64)


def knorm_float32(full, at: int, budget: int, layer: int) -> np.ndarray:
    """kvpress's Knorm from kvsim's keys: the float32 norms ranked by ``torch.topk`` (its
    order among equal norms), where kvsim ranks float64 norms with its own tie rule."""
    import torch

    keys = torch.from_numpy(np.ascontiguousarray(full.keys[layer, :, :at]))
    scores = -torch.linalg.vector_norm(keys, dim=-1, dtype=torch.float32)
    return np.sort(scores.topk(budget, dim=-1).indices.numpy(), axis=1)


def chunkkv_whole_context(full, at: int, budget: int, layer: int, params: dict) -> np.ndarray:
    """kvpress's ChunkKVPress over SnapKVPress at prefill, from kvsim's full-cache attention:
    per KV head, SnapKV's scores at kvpress's scale (the last ``window`` context queries'
    mean attention on the keys before them, average-pooled over ``kernel`` keys, averaged
    over the group's query heads), the window's positions scored the maximum + 1; summed
    over the layer's KV heads, the whole context cut into chunks of ``chunk`` from position
    0 (the last one partial, at the context's end), each scored by its mean in float32; the
    top ``max(1, int(n_chunks * (1 - r)))`` by ``torch.topk`` at the ratio ``r`` that keeps
    ``budget`` keys (:func:`~kvsim.tools.study.presses.ratio`), the same for every KV head."""
    import torch
    from torch.nn import functional as F

    from kvsim.policies import snapkv
    from kvsim.tools.study.presses import n_kept, ratio

    H_kv, w, chunk = full.keys.shape[1], params["window"], params["chunk"]
    r = ratio(at, budget)
    if r == 0.0:  # kvpress keeps everything
        return np.array([np.arange(at)] * H_kv, np.int64)
    votes = [full.prompt_attention(layer, j, at)[:, at - w:, :at - w].mean(axis=1)
             for j in range(H_kv)]
    scores = torch.from_numpy(np.array([np.mean([snapkv.pool(v, params["kernel"], 1) for v in g],
                                                axis=0) for g in votes], np.float32))[None]
    scores = F.pad(scores, (0, w), value=scores.max().item() + 1)
    whole, rest = divmod(at, chunk)
    if whole == 0:  # kvpress's ChunkKV leaves a context shorter than a chunk to SnapKV
        return np.sort(scores[0].topk(n_kept(at, r), dim=-1).indices.numpy(), axis=1)
    per_chunk = scores[..., :whole * chunk].sum(dim=1).view(-1, whole, chunk).mean(dim=-1)
    if rest:
        per_chunk = torch.cat([per_chunk, scores[..., -rest:].sum(dim=1).mean(
            dim=-1, keepdim=True)], dim=-1)
    chosen = per_chunk.topk(max(1, int((whole + (rest > 0)) * (1 - r))), dim=-1).indices[0]
    kept = np.sort(np.concatenate([np.arange(c * chunk, min(at, (c + 1) * chunk))
                                   for c in chosen.tolist()]))
    return np.array([kept] * H_kv, np.int64)


def _none(params: dict, seed: int) -> dict:
    return {}


@dataclass(frozen=True)
class Twin:
    """A kvsim policy's kvpress press: ``kwargs(params, seed)`` its keyword arguments from
    the policy's parameters; ``needs``: the parameters the twin assumes; ``exact``: False
    when only the accuracy compares (a random draw); ``rule``: kvsim's rule that differs on
    purpose, and ``compatible(full, at, budget, layer, params)`` the (H_kv, n) positions
    kvsim keeps with that difference switched to kvpress's behaviour."""

    press: str
    kwargs: Callable[[dict, int], dict] = _none
    needs: dict = dataclasses.field(default_factory=dict)
    exact: bool = True
    rule: str = ""
    compatible: Callable | None = None


TWINS = {
    "streaming_llm": Twin("StreamingLLMPress", lambda p, s: {"n_sink": p["sinks"]}),
    "snapkv": Twin("SnapKVPress", lambda p, s: {"window_size": p["window"],
                                                "kernel_size": p["kernel"]},
                   {"pooling": "avg", "protect_window": True}),
    "knorm": Twin("KnormPress", needs={"recent_ratio": 0.0},
                  rule="kvsim ranks float64 key norms (ties: its rule); kvpress float32 "
                       "norms by torch.topk",
                  compatible=lambda full, at, b, layer, p: knorm_float32(full, at, b, layer)),
    "keydiff": Twin("KeyDiffPress", needs={"recent_ratio": 0.0}),
    "expected_attention": Twin("ExpectedAttentionPress", lambda p, s: {
        "n_sink": p["n_sink"], "n_future_positions": p["n_future"],
        "use_covariance": p["covariance"], "use_vnorm": p["vnorm"]}),
    "h2o": Twin("ObservedAttentionPress", needs={"normalize": True, "recent_ratio": 0.0}),
    "tova": Twin("TOVAPress", rule="kvsim scores by each KV head's own query heads (TOVA's "
                                   "paper); kvpress by the mean over all query heads of the "
                                   "layer, the last position kept",
                 compatible=lambda full, at, b, layer, p: tova_all_heads(full, at, b, layer)),
    "random": Twin("RandomPress", lambda p, s: {"seed": s}, exact=False),
    "chunkkv": Twin(
        "ChunkKVPress", lambda p, s: {"press": {"press": "SnapKVPress", "window_size": p["window"],
                                                "kernel_size": p["kernel"]},
                                      "chunk_length": p["chunk"]}, {"pooling": "avg"},
        rule="kvsim chunks the prefix before the SnapKV window (its partial chunk at the "
             "prefix's end), pins floor((B - window) / chunk) chunks (ties: the lower index) and "
             "keeps the window and the newest positions in a ring, exactly B keys; kvpress "
             "chunks the whole context (its partial chunk at the context's end), scores the "
             "window's positions the maximum SnapKV score + 1 (scores at its scale: means over "
             "the window's queries and the group), and keeps max(1, int(n_chunks * (1 - r))) "
             "chunks by torch.topk at the ratio r that keeps B keys for its other presses: "
             "whole chunks, not exactly B keys, the window only where its chunks are chosen",
        compatible=chunkkv_whole_context),
}


def twin_press(pc: PolicyConfig, seed: int, where: str = "") -> PolicyConfig:
    """The kvpress press (a :class:`PolicyConfig` of its class and keyword arguments) twin
    to kvsim's policy ``pc``; a policy without one, or with parameters its twin does not
    have, is a one-line :class:`KvsimError` (``where``: the file)."""
    twin = TWINS.get(pc.kind)
    if twin is None:
        raise KvsimError(f"{where}policies.{pc.label}: expected a policy with a kvpress twin "
                         f"({', '.join(TWINS)}), got {pc.kind!r}")
    for key, value in twin.needs.items():
        if pc.params[key] != value:
            raise KvsimError(f"{where}policies.{pc.label}.{key}: expected {value!r} (as "
                             f"{twin.press} does), got {pc.params[key]!r}")
    return PolicyConfig(pc.label, twin.press, twin.kwargs(pc.params, seed))


def kept_sets(caches, layers: list[int]) -> list[list[list[int]]]:
    """Per run of ``caches``, the sorted positions each (layer of ``layers``, KV head) holds."""
    return [[sorted(caches.steppers[c][layer][j].cache.tolist()) for layer in layers
             for j in range(len(caches.steppers[c][layer]))] for c in range(len(caches.runs))]


def first_difference(ours: list, theirs: list, layers: list[int], H_kv: int) -> tuple[int, str]:
    """(how many (layer, KV head) sets differ, the first as "layer L head J: kvsim only
    [...], kvpress only [...]", or "") of two runs' :func:`kept_sets` rows."""
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    if not differ:
        return 0, ""
    i = differ[0]
    a, b = set(ours[i]), set(theirs[i])
    return len(differ), (f"layer {layers[i // H_kv]} head {i % H_kv}: kvsim only "
                         f"{_few(sorted(a - b))}, kvpress only {_few(sorted(b - a))}")


def _few(positions: list[int], shown: int = 8) -> str:
    """The first ``shown`` of ``positions``, then how many more."""
    more = f" and {len(positions) - shown} more" if len(positions) > shown else ""
    return f"{positions[:shown]}{more}"


def kvpress_answer(net, press, prompt, steps: int, layers: list[int] | None = None,
                   context_keys: np.ndarray | None = None):
    """kvpress's pipeline on one question: the context prefilled under ``press`` into a
    ``DynamicCache``, then the question (positions from the context's length) and a greedy
    answer of ``steps`` tokens (no stop at EOS), on the eager model. Returns the tokens,
    the kept positions per layer of ``layers`` (matched to ``context_keys``; None without
    them) and the seconds the pipeline took."""
    import torch

    from kvsim.models.adapter import attach
    from kvsim.tools.study.press_prefill import positions, press_prefill

    at = prompt.ids.size - prompt.question_len
    start = time.perf_counter()
    cache = press_prefill(net, press, prompt.ids[:at])
    seconds = time.perf_counter() - start
    held = None if layers is None else positions(cache, context_keys, layers,
                                                 type(press).__name__)
    start = time.perf_counter()
    net.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            pos = torch.arange(at, prompt.ids.size)[None]
            out = net(input_ids=torch.as_tensor(prompt.ids[None, at:]), past_key_values=cache,
                      position_ids=pos, logits_to_keep=1)
            tokens = [int(out.logits[0, -1].argmax())]
            for i in range(steps - 1):
                out = net(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                          position_ids=pos[:, -1:] + 1 + i)
                tokens.append(int(out.logits[0, -1].argmax()))
    finally:
        attach(net)
    return np.array(tokens), held, seconds + time.perf_counter() - start


def kvsim_seconds(net, cfg, prompt, pc: PolicyConfig, budget: int) -> float:
    """The seconds of one compressed run of kvsim: the full prefill, the policy's
    selection at ``budget`` and the answer's decode."""
    from kvsim.protocols.run import get_policy
    from kvsim.tools.study.model import prefill
    from kvsim.tools.task import run

    start = time.perf_counter()
    full = prefill(net, prompt.ids, logits_to_keep=1, rope="rope" in get_policy(pc.kind).needs)
    one = dataclasses.replace(cfg, policies=(pc,), budgets=(budget,))
    protocols, _ = run.compress(full, prompt, one)
    run.answer(net, full, protocols["prefill_only"], cfg.answer_tokens)
    return time.perf_counter() - start


def trial_rows(net, tokenizer, cfg, cell: tuple, text_ids, form, timed: bool = False
               ) -> list[dict]:
    """Every policy x budget of ``cfg`` on one trial: kvsim's run, its twin's, compared;
    ``timed``: at the largest budget, one compressed run of kvsim alone timed too
    (:func:`kvsim_seconds`), the load average beside it."""
    from kvsim.protocols.run import get_policy
    from kvsim.tools.task import inputs, run
    from kvsim.tools.task.press_runs import held_caches
    from kvsim.tools.study.presses import make, ratio

    prompt, full, full_tokens, _ = run.full_trial(
        net, tokenizer, cfg, cell, text_ids, form,
        rope=any("rope" in get_policy(pc.kind).needs for pc in cfg.policies))
    at = prompt.ids.size - prompt.question_len
    layers, H_kv = full.global_layers, full.keys.shape[1]
    protocols, rows_of = run.compress(full, prompt, cfg)
    ours = protocols["prefill_only"]
    our_sets = kept_sets(ours, layers)  # before the answer joins them
    mine, _ = run.answer(net, full, ours, cfg.answer_tokens)
    compatible = [pc for pc in cfg.policies if TWINS[pc.kind].compatible]

    def compatible_held(pc, b):
        return {layer: TWINS[pc.kind].compatible(full, at, b, layer, pc.params)
                for layer in layers}

    switched, switched_sets, switched_tokens = None, [], []
    if compatible:
        switched = held_caches(full, prompt, cfg, rows_of, compatible, compatible_held)
        switched_sets = kept_sets(switched, layers)
        switched_tokens = run.answer(net, full, switched, cfg.answer_tokens)[0]
    key = prompt.key
    full_answer = tokenizer.decode(full_tokens.tolist())
    rows = []
    for c, (pc, b) in enumerate(ours.runs):
        twin = TWINS[pc.kind]
        press = twin_press(pc, cfg.seed)
        tokens, held, seconds = kvpress_answer(net, make(press, ratio(at, b)), prompt,
                                               cfg.answer_tokens, layers, full.keys[:, :, :at])
        theirs = [sorted(held[layer][j].tolist()) for layer in layers for j in range(H_kv)]
        differ, first = first_difference(our_sets[c], theirs, layers, H_kv)
        answers = [tokenizer.decode(t.tolist()) for t in (mine[c], tokens)]
        row = {"policy": pc.label, "kind": pc.kind, "press": press.kind,
               "length": cell[0], "depth": cell[1], "trial": cell[2], "budget": b, "key": key,
               "exact": int(twin.exact), "equal_kept": int(differ == 0),
               "differing_heads": differ, "first_difference": first,
               "identical_answer": int(np.array_equal(mine[c], tokens)),
               "kvsim_success": int(inputs.first_number(answers[0]) == key),
               "kvpress_success": int(inputs.first_number(answers[1]) == key),
               "full_success": int(inputs.first_number(full_answer) == key),
               "kvsim_answer": answers[0], "kvpress_answer": answers[1],
               "kvpress_seconds": round(seconds, 3), "kvsim_seconds": "", "load_1min": "",
               "compatible_equal_kept": "", "compatible_identical_answer": ""}
        if twin.compatible:
            k = compatible.index(pc) * len(cfg.budgets) + cfg.budgets.index(b)
            row["compatible_equal_kept"] = int(switched_sets[k] == theirs)
            row["compatible_identical_answer"] = int(np.array_equal(switched_tokens[k], tokens))
        if timed and b == max(cfg.budgets):
            row["kvsim_seconds"] = round(kvsim_seconds(net, cfg, prompt, pc, b), 3)
            row["load_1min"] = round(os.getloadavg()[0], 2)
        rows.append(row)
    return rows


def _trial(index: int) -> list[dict]:
    from kvsim.tools.task.run import cells

    net, tokenizer, cfg, text_ids, form = FORKED["job"]
    grid = cells(cfg)
    return trial_rows(net, tokenizer, cfg, grid[index], text_ids, form,
                      timed=index == 0)


def parity_rows(cfg, net, tokenizer, workers: int = 1, progress: bool = True) -> list[dict]:
    """Every run of ``cfg``'s grid (:func:`trial_rows`), in grid order, the trials on
    ``workers`` forked processes (the longest first); the grid's first trial times one run
    of each side at the largest budget."""
    from kvsim.models.adapter import attach
    from kvsim.tools.task.command import filler_ids, prompt_frame
    from kvsim.tools.task.run import cells

    attach(net)
    order = list(range(len(cells(cfg))))[::-1]
    done = forked_map(_trial, order, workers, (net, tokenizer, cfg, filler_ids(cfg, tokenizer),
                                               prompt_frame(cfg, tokenizer)))
    if progress:
        print(f"{cfg.name}: {len(order)} trials", file=sys.stderr)
    return [r for rows in done[::-1] for r in rows]


def check(cfg) -> None:
    """A task file fit for parity: the passkey kind, ``prefill_only`` among its protocols,
    every policy with a kvpress twin, no press tables; each problem a one-line
    :class:`KvsimError`."""
    where = f"{cfg.path}: "
    require_passkey(cfg, "the parity scores the passkey's answer")
    if "prefill_only" not in cfg.compress:
        raise KvsimError(f"{where}task.compress: expected 'prefill_only' (kvpress's protocol), "
                         f"got {list(cfg.compress)}")
    if cfg.presses or not cfg.policies:
        raise KvsimError(f"{where}policies: expected kvsim's policies only (their kvpress "
                         f"twins are chosen for them)")
    for pc in cfg.policies:
        twin_press(pc, cfg.seed, where)


def _share(rows: list[dict], column: str) -> str:
    return f"{sum(int(r[column]) for r in rows)} / {len(rows)}"


def report_lines(cfg, rows: list[dict], facts: dict) -> list[str]:
    """The Markdown of the parity report."""
    from kvsim.tools.study.presses import press_text

    load = ", ".join(f"{x:.2f}" for x in facts["load_average"])
    timed = {r["policy"]: r for r in rows if r["kvsim_seconds"] != ""}
    n, d, t = next((r["length"], r["depth"], r["trial"]) for r in timed.values())
    out = [f"# kvsim against kvpress: {cfg.name}", "",
           f"Produced by `{facts['command']}` (kvsim {facts['kvsim']}, commit "
           f"`{facts['commit']}`, kvpress {facts['kvpress']}, transformers "
           f"{facts['transformers']}, torch {facts['torch']} on 1 thread; {facts['date']}; "
           f"{facts['wall_seconds'] / 60:.0f} min; load average {load} at the end).", "",
           f"Model `{cfg.gguf_file or cfg.model}`; prompts `{cfg.prompt}` of "
           f"{', '.join(map(str, cfg.lengths))} tokens, needle depths "
           f"{', '.join(map(str, cfg.depths))}, {cfg.trials} trial(s) each, seed {cfg.seed}; "
           f"budgets {', '.join(map(str, cfg.budgets))}; {cfg.answer_tokens} answer tokens. "
           "Both sides under `prefill_only`: the context (the prompt minus its question) is "
           "compressed once to exactly B keys per layer and KV head, then the question and "
           "the answer join with no eviction. kvsim's answer is its own decoder's; kvpress's "
           "is its pipeline's (eager attention, a `DynamicCache`).", "",
           "| kvsim policy | kvpress press | runs | equal kept sets (every layer and KV "
           "head) | identical answers | kvsim successes | kvpress successes | kvsim s/run | "
           "kvpress s/run | load (1 min) |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for pc in cfg.policies:
        mine = [r for r in rows if r["policy"] == pc.label]
        press = twin_press(pc, cfg.seed)
        clock = timed[pc.label]
        equal = _share(mine, "equal_kept") if TWINS[pc.kind].exact else "(not compared)"
        out.append(f"| {pc.label} (`{pc.kind}`) | {press_text(press.kind, press.params)} | "
                   f"{len(mine)} | "
                   f"{equal} | {_share(mine, 'identical_answer')} | "
                   f"{_share(mine, 'kvsim_success')} | {_share(mine, 'kvpress_success')} | "
                   f"{clock['kvsim_seconds']:.1f} | {clock['kvpress_seconds']:.1f} | "
                   f"{clock['load_1min']:.2f} |")
    prompts = {(r["length"], r["depth"], r["trial"]): r["full_success"] for r in rows}
    out += ["", f"The full cache answers {sum(prompts.values())} of the {len(prompts)} "
                "prompts.", "", f"Seconds of one compressed run each, on one prompt ({n} tokens, depth "
                f"{d}, trial {t}) at budget {max(cfg.budgets)}: kvsim's full prefill, selection "
                "and answer decode; kvpress's prefill under the press, question and answer. "
                "One run each, on a machine shared with other work: compare them within a "
                "row, with the load beside them."]
    switched = [pc for pc in cfg.policies if TWINS[pc.kind].compatible]
    if switched:
        out += ["", "## Rules that differ on purpose, switched to kvpress's", "",
                "| kvsim policy | kvsim's rule against kvpress's | runs | equal kept sets "
                "as is | equal kept sets switched | identical answers as is | identical "
                "answers switched |", "|---|---|---|---|---|---|---|"]
        for pc in switched:
            mine = [r for r in rows if r["policy"] == pc.label]
            out.append(f"| {pc.label} | {TWINS[pc.kind].rule} | {len(mine)} | "
                       f"{_share(mine, 'equal_kept')} | {_share(mine, 'compatible_equal_kept')}"
                       f" | {_share(mine, 'identical_answer')} | "
                       f"{_share(mine, 'compatible_identical_answer')} |")
        out += ["", "Switched: kvsim's selection made from its own full prefill with kvpress's "
                    "rule, decoded by kvsim's decoder, against kvpress's own run."]
    differ = [r for r in rows if TWINS[r["kind"]].exact and not r["equal_kept"]]
    out += ["", "## Where the kept sets differ", ""]
    if not differ:
        out.append("Nowhere: every exact twin kept the same positions in every layer and "
                   "KV head of every run.")
    for r in differ:
        out.append(f"- {r['policy']}, {r['length']} tokens, depth {r['depth']}, trial "
                   f"{r['trial']}, B = {r['budget']}: {r['differing_heads']} (layer, KV head) "
                   f"sets differ; first {r['first_difference']}")
    out += ["", "`random` draws its own positions on each side (numpy against torch): only "
                "its successes compare. Every run is a row of `results.csv`."]
    return out


def write_report(cfg, rows: list[dict], facts: dict, folder: Path) -> None:
    """``report.md`` and ``results.csv`` into ``folder``."""
    with open(folder / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (folder / "report.md").write_text("\n".join(report_lines(cfg, rows, facts)) + "\n")


def parity_report(path: str | Path, out: Path, *, workers: int = 1,
                  command: str | None = None, progress: bool = True) -> Path:
    """Run the parity of a task file (see the module's docstring) and write ``out``."""
    from importlib.metadata import version

    import torch
    import transformers

    from kvsim.report.lock import replace_folder
    from kvsim.models.capture import load_model
    from kvsim.models.threads import one_thread
    from kvsim.tools.study.run import provenance
    from kvsim.tools.task.config import load_config
    from kvsim.tools.study.presses import presses_module

    start, started = time.perf_counter(), time.time()
    cfg = load_config(path)
    check(cfg)
    presses_module()
    net, tokenizer = load_model(str(cfg.model), cfg.gguf_file)
    with one_thread():
        rows = parity_rows(cfg, net, tokenizer, workers, progress)
    command = command or " ".join(["python -m kvsim.tools.task.parity", str(path), "--out",
                                   str(out), *(["--workers", str(workers)] if workers > 1
                                               else [])])
    facts = {**provenance(command, workers, start, started), "kvpress": version("kvpress"),
             "transformers": transformers.__version__, "torch": torch.__version__}
    replace_folder(Path(out), lambda tmp: write_report(cfg, rows, facts, tmp))
    return Path(out)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvsim.tools.task.parity FILE --out DIR``; a problem is one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m kvsim.tools.task.parity",
                                     description="kvsim's policies against their kvpress "
                                                 "twins on a task file's prompts")
    parser.add_argument("file")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--workers", type=int, default=1,
                        help="forked processes for the trials (torch on one thread each)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    try:
        out = parity_report(args.file, args.out, workers=args.workers,
                            progress=not args.quiet)
    except KvsimError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    print(out / "report.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
