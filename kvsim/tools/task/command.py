"""``python -m kvsim task FILE.toml``: validate, run every trial, write the report folder."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvsim.errors import KvsimError
from kvsim.report.lock import replace_folder
from kvsim.report.writer import check_study_out
from kvsim.tools.study import write_study
from kvsim.tools.task.config import TaskConfig, load_config

_FORKED: dict = {}  # what forked workers inherit: the model, the tokenizer, the settings


def check_task_out(out: Path, force: bool, name: str) -> str | None:
    """``out`` may receive the report (see :func:`~kvsim.report.writer.check_study_out`)."""
    return check_study_out(out, force, "task.json", name, "task")


def _trial(index: int) -> list[dict]:
    from kvsim.tools.task.run import cells

    net, tokenizer, cfg, text_ids, form, trial = _FORKED["job"]
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
    from kvsim.tools.adapter import attach
    from kvsim.tools.closed_loop.run import forked_pool
    from kvsim.tools.task.run import cells, gate_trial
    from kvsim.tools.task.trial import run_trial

    attach(net)
    n = len(cells(cfg))
    _FORKED["job"] = (net, tokenizer, cfg, filler_ids(cfg, tokenizer), prompt_frame(cfg, tokenizer),
                      gate_trial if gate_only else run_trial)
    try:
        with tqdm(total=n, unit="trial", desc=cfg.name, disable=not progress) as bar:
            if workers <= 1:
                rows = []
                for i in range(n):
                    rows += _trial(i)
                    bar.update()
                return rows
            with forked_pool(min(workers, n)) as pool:
                results = []
                for rows in pool.map(_trial, range(n)):
                    results.append(rows)
                    bar.update()
                return [r for rows in results for r in rows]
    finally:
        _FORKED.clear()


def task_report(path: str | Path, out: Path | None = None, *, force: bool = False,
                progress: bool = True, workers: int = 1, command: str | None = None) -> Path:
    """Run a task file and write its report (default ``reports/<name>/``); the trials run on
    ``workers`` forked processes. Returns the report folder."""

    def work(cfg: TaskConfig, out: Path, provenance) -> None:
        net, tokenizer, rows = _trials(cfg, workers, progress, False)
        from kvsim.tools import models
        from kvsim.tools.closed_loop.model import prefill

        probe = prefill(net, np.zeros(2, np.int64), logits_to_keep=1)  # each layer's geometry
        facts = {**provenance(),
                 "layers": net.config.num_hidden_layers,
                 "heads": net.config.num_attention_heads,
                 "kv_heads": net.config.num_key_value_heads,
                 "global_layers": probe.global_layers,
                 "windows": sorted({g.window for g in probe.geometry if g.window}),
                 "licence": models.licence(cfg.gguf_file),
                 "question_len": rows[0]["question_len"]}
        from kvsim.tools.task.report import KEPT, write_files

        replace_folder(out, lambda tmp: write_files(cfg, rows, facts, tmp), keep=KEPT,
                       advice=f": draw the report from them with `python -m kvsim task {path} "
                              f"--out {out} --redraw`")

    return write_study(path, out, force, command or f"kvsim task {path}", workers,
                       load_config, check_task_out, work)


def _trials(cfg: TaskConfig, workers: int, progress: bool, gate_only: bool):
    """The model, its tokenizer and the rows of every trial of ``cfg``."""
    import torch

    from kvsim.tools.capture import load_model

    net, tokenizer = load_model(str(cfg.model), cfg.gguf_file)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # results then do not depend on the machine's core count
    try:
        return net, tokenizer, run_all(cfg, net, tokenizer, workers, progress, gate_only)
    finally:
        torch.set_num_threads(threads)


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


# Settings that only shape the report: a redraw may change them.
REDRAWABLE = ("description", "focus_budget", "bootstrap", "formats", "dpi")


def redraw_report(path: str | Path, out: Path | None = None, *,
                  command: str | None = None) -> Path:
    """Rewrite the figures and text of the task report of ``path`` (default
    ``reports/<name>/``) from its results.csv and task.json, without the model: the trials
    stay those of the run that wrote it, which must have had the file's settings (apart from
    :data:`REDRAWABLE`). Returns the folder."""

    def work(cfg: TaskConfig, out: Path, provenance) -> None:
        from kvsim.tools.study import settings_of
        from kvsim.tools.task.report import read_rows, write_files

        saved = out / "task.json"
        if not saved.is_file() or not (out / "results.csv").is_file():
            raise KvsimError(f"{out}: expected a task report to redraw (task.json and "
                             f"results.csv); run without --redraw to make one")
        info = json.loads(saved.read_text())
        info["settings"].setdefault("kind", "passkey")  # a report from before task kinds
        now = json.loads(json.dumps(settings_of(cfg), default=str))
        differ = sorted(k for k in {*now, *info["settings"]} - set(REDRAWABLE)
                        if now.get(k) != info["settings"].get(k))
        if differ:
            raise KvsimError(f"{path}: {', '.join(differ)} differ from the settings of the "
                             f"report in {out}; run without --redraw to run the trials again")
        try:
            rows = read_rows(out / "results.csv")
        except (ValueError, KeyError) as exc:
            raise KvsimError(f"{out / 'results.csv'}: {exc}") from None
        now_facts = provenance()
        facts = {**info["facts"], "redrawn": {k: now_facts[k]
                                              for k in ("command", "kvsim", "commit", "date")}}
        replace_folder(out, lambda tmp: write_files(cfg, rows, facts, tmp), keep=())

    return write_study(path, out, False, command or f"kvsim task {path} --redraw", 1,
                       load_config, check_task_out, work)
