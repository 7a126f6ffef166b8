"""Task files: TOML -> a validated, frozen :class:`TaskConfig` (before torch is imported).

A task file holds a ``[task]`` table (the model, the grid of lengths x depths x trials, the
budgets, the protocols, the filler) and ``[policies.NAME]`` tables read exactly as in a
scenario or closed-loop file. Every problem is one line ``FILE: key.path: expected ...``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import ScenarioError
from kvsim.params import Param
from kvsim.protocols.question import COMPRESS, TASK_COMPRESS
from kvsim.scenario.reader import Checker, PolicyConfig, is_int
from kvsim.texts import SHIPPED, shipped_text
from kvsim.models import catalog
from kvsim.tools.task.inputs import PROMPTS
from kvsim.tools.task.kinds import DECODE_RECALL, KINDS, NAMES, PASSKEY
from kvsim.tools.study.presses import read_presses
from kvsim.tools.study.file import (BOOTSTRAP, GQA, MODEL_SETTINGS, check_context, read_focus,
                                    read_model, read_output, read_steppable_policies,
                                    read_study_file)

TOP_KEYS = ("name", "description", "task", "policies", "output")
FILLERS = ("seeded", *SHIPPED)
MIN_LENGTH = 128  # room for the frame (description and question: 40 tokens raw, 70 chat on
# SmolLM2), the needle and 40 tokens of filler, which the run checks with the tokenizer

SETTINGS = {
    **MODEL_SETTINGS,
    "kind": Param(str, PASSKEY, "the task: 'passkey', or one of RULER's needle family "
                  "(docs/tasks.md, kvsim/tools/task/kinds.py)", choices=NAMES),
    "trials": Param(int, 5, "trials per length x depth cell (a new key and filler each)",
                    low=1, high=10_000),
    "seed": Param(int, 0, "seed of the keys, the filler and seeded policies",
                  check=lambda v: v >= 0, expect="an integer >= 0"),
    "focus_budget": Param(int, 0, "budget of the depth x length heatmaps (0: the second "
                          "smallest)", check=lambda v: v >= 0, expect="an integer >= 0"),
    "filler": Param(str, "seeded", "the haystack: 'seeded' (sentences drawn from a word list "
                    "by the seed) or a text shipped with kvsim, cut at a seeded offset",
                    choices=FILLERS),
    "prompt": Param(str, "raw", "the prompt's format: 'raw' (the tokenizer's special tokens, "
                    "the task description, the haystack, the question) or 'chat' (the same "
                    "inside the model's chat template)", choices=PROMPTS),
    "answer_tokens": Param(int, 8, "tokens generated greedily from each cache (default: 8 "
                           "for the passkey, RULER's tokens_to_generate for its kinds: 128, "
                           "vt 30)",
                           check=lambda v: 1 <= v <= 128, expect="an integer in [1, 128]"),
    "generate_tokens": Param(int, 64, "decode_recall only: the tokens each cache generates "
                             "greedily after the prompt, before the question comes",
                             check=lambda v: 1 <= v <= 1024, expect="an integer in [1, 1024]"),
    "gqa": GQA,
    "bootstrap": BOOTSTRAP,
}
LISTS = ("lengths", "depths", "budgets", "compress")


@dataclass(frozen=True)
class TaskConfig:
    """A validated task file."""

    path: Path
    name: str
    description: str
    model: Path
    gguf_file: str | None
    lengths: tuple[int, ...]
    depths: tuple[float, ...]
    trials: int
    seed: int
    budgets: tuple[int, ...]
    focus_budget: int
    compress: tuple[str, ...]
    filler: str
    prompt: str
    answer_tokens: int
    gqa: str
    bootstrap: int
    policies: tuple[PolicyConfig, ...]
    formats: tuple[str, ...]
    dpi: int
    presses: tuple[PolicyConfig, ...] = ()  # kvpress's (presses.py), under prefill_only
    kind: str = PASSKEY  # the task (kinds.py)
    generate_tokens: int = 0  # decode_recall's generated stretch; 0 for the other kinds

    @property
    def filler_path(self) -> Path | None:
        """The shipped text of the filler, or None for seeded sentences."""
        return shipped_text(self.filler)


def _int_list(chk: Checker, raw, where: str, low: int) -> list[int]:
    if not isinstance(raw, list) or not raw or any(not is_int(v) or v < low for v in raw) \
            or len(set(raw)) != len(raw):
        chk.add(where, f"expected a non-empty list of distinct integers >= {low}, got {raw!r}")
        return []
    return sorted(raw)


def _depths(chk: Checker, raw) -> list[float]:
    if not isinstance(raw, list) or not raw or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1
            for v in raw) or len(set(raw)) != len(raw):
        chk.add("task.depths", f"expected a non-empty list of distinct numbers in [0, 1] "
                               f"(relative depth of the needle in the context), got {raw!r}")
        return []
    return sorted(float(v) for v in raw)


def _compress(chk: Checker, raw) -> list[str]:
    if not isinstance(raw, list) or not raw or any(v not in TASK_COMPRESS for v in raw) \
            or len(set(raw)) != len(raw):
        chk.add("task.compress", f"expected a non-empty list of distinct protocols among "
                                 f"{', '.join(TASK_COMPRESS)}, got {raw!r}")
        return []
    return list(raw)


def _check_filler(chk: Checker, filler: str, model: Path | None, gguf: str | None,
                  longest: int) -> None:
    """The shipped text ``filler`` holds ``longest`` tokens: its count under a named model's
    tokenizer where known (:func:`kvsim.models.catalog.text_tokens`), else at most its bytes
    (a token covers at least one byte)."""
    known = catalog.text_tokens(gguf, filler) if model is not None else None
    have = known if known is not None else len(shipped_text(filler).read_bytes())
    if have < longest:
        chk.add("task.filler", f"expected a text of at least {longest} tokens (the longest "
                               f"length), got {have} {'tokens' if known else 'bytes'} in "
                               f"{filler!r}")


def load_config(path: str | Path) -> TaskConfig:
    """Read and validate a task file; problems raise :class:`ScenarioError`."""
    path, doc, chk, name, description, table = read_study_file(path, "task", TOP_KEYS)
    s = chk.params(table, SETTINGS, "task.", skip=LISTS)
    if "answer_tokens" not in table and s.get("kind") in KINDS:  # RULER's answer length
        s["answer_tokens"] = KINDS[s["kind"]].tokens
    if s.get("kind") not in (None, DECODE_RECALL):  # None: a bad kind, already reported
        if "generate_tokens" in table:
            chk.add("task.generate_tokens", f"expected no generate_tokens for kind "
                                            f"{s['kind']!r} (a setting of decode_recall "
                                            f"alone), got {table['generate_tokens']!r}")
        s["generate_tokens"] = 0
    elif s.get("kind") == DECODE_RECALL and s.get("prompt") == "chat":
        chk.add("task.prompt", f"expected 'raw' for kind {DECODE_RECALL!r} (its question "
                               f"follows the model's own tokens, not a chat turn), got 'chat'")
    lengths = _int_list(chk, table.get("lengths"), "task.lengths", MIN_LENGTH)
    depths = _depths(chk, table.get("depths"))
    budgets = _int_list(chk, table.get("budgets"), "task.budgets", 1)
    compress = _compress(chk, table.get("compress", list(COMPRESS)))
    if lengths and budgets and max(budgets) >= min(lengths):
        chk.add("task.budgets", f"expected budgets below the shortest length "
                                f"({min(lengths)} tokens), got {max(budgets)}")
    model, gguf = None, None
    if "model" in s and "gguf_file" in s:
        model, gguf = read_model(chk, "task", s, path.parent)
    if s.get("prompt") == "chat" and model is not None and \
            catalog.chat_template(model, gguf) is False:  # read from the tokenizer's files
        chk.add("task.prompt", "expected 'raw' for a model whose tokenizer has no chat "
                               "template, got 'chat'")
    if lengths and s.get("filler", "seeded") != "seeded":
        _check_filler(chk, s["filler"], model, gguf, max(lengths))
    generate = s.get("generate_tokens", 0)
    answer = s.get("answer_tokens", 1) + generate  # the tokens after a prompt
    if lengths:
        check_context(chk, "task.lengths", model, gguf, max(lengths) + answer,
                      f"(the longest length plus answer_tokens"
                      f"{' and generate_tokens' if generate else ''})")
    shortest = min(lengths) if lengths else 0  # each trial decodes its answer after its prompt
    tables = doc.get("policies")
    given = len(tables) if isinstance(tables, dict) else 0
    family = catalog.family(model, gguf) if model is not None else None  # refused if not
    # one of catalog.FAMILIES (read_model); kvpress's before kvsim's: it takes their tables
    presses = read_presses(chk, doc, compress, family if family in catalog.FAMILIES else None,
                           shortest, budgets)
    configs = read_steppable_policies(chk, doc, budgets, shortest + answer, shortest,
                                      bool(lengths) and "answer_tokens" in s,
                                      set(compress) != {"after_question"}) \
        if not given or doc["policies"] else {}  # {}: presses only
    focus = read_focus(chk, "task.focus_budget", s.get("focus_budget", 0), budgets)
    formats, dpi = read_output(chk, doc)
    if chk.problems:
        raise ScenarioError(chk.problems)
    return TaskConfig(path.resolve(), name, description, model, gguf, tuple(lengths),
                      tuple(depths), s["trials"], s["seed"], tuple(budgets), focus,
                      tuple(compress), s["filler"], s["prompt"], s["answer_tokens"], s["gqa"],
                      s["bootstrap"], tuple(configs.values()), tuple(formats), dpi,
                      tuple(presses.values()), s["kind"], s["generate_tokens"])
