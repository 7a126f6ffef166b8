"""The passkey inputs: deterministic from the seed, no download, in the model's own format.

A prompt of exactly ``n`` tokens is

    head + filler[:a] + needle + filler[a:] + question

- ``head``: what the model expects before any text (its tokenizer's special tokens: Gemma-3's
  ``<bos>``; SmolLM2's tokenizer adds none) and the passkey test's task description
  (:data:`DESCRIPTION`, the literature's form); under ``prompt = "chat"`` the model's chat
  template opens a user turn first;
- ``needle``: " The pass key is NNNNN. Remember it. NNNNN is the pass key." (the key a
  5-digit number drawn from the trial's seed);
- ``question``: "\\nWhat is the pass key? The pass key is" (``raw``) or, under ``chat``, the
  question, the template's end of the user turn and start of the model's turn, then "The
  pass key is"; its ``Q`` tokens are the question of the protocols;
- ``filler``: ``n - len(head) - Q - len(needle)`` tokens of haystack, either sentences drawn
  from a fixed list (the classic passkey haystack) by a NumPy generator seeded with the
  trial's seed (``seeded``), or a text shipped with kvsim cut at a seeded offset;
- ``a``: the filler's sentence boundary (a position after a token ending in ".", or 0)
  nearest to ``d * len(filler)``: the needle's relative depth in the haystack is ``d`` up to
  half a sentence.

Each piece is tokenised on its own and the ids concatenated, so the counts are exact; the
special tokens are the ones the tokenizer itself adds to a whole text (:func:`specials`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

DESCRIPTION = ("There is an important info hidden inside a lot of irrelevant text. Find it "
               "and memorize it. I will quiz you about the important information there.")
ASK, ANSWER = "\nWhat is the pass key?", "The pass key is"  # the question around a chat turn
QUESTION = f"{ASK} {ANSWER}"  # the raw question: "\nWhat is the pass key? The pass key is"
PROMPTS = ("raw", "chat")
SENTENCES = (  # the classic passkey haystack (Mohtashami and Jaggi 2023), and three alike
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river is wide.", "The night is dark.", "The road is long.")


@dataclass(frozen=True)
class Prompt:
    """One trial's prompt: ``ids`` (n,) int64; the key; the needle's first position and
    the positions of the key's digit tokens, one array per occurrence; the question's
    length ``Q`` (the prompt's last ``Q`` tokens; decode_recall: its first task);
    ``context_start``: the haystack's first position (after the special tokens and the task
    description)."""

    ids: np.ndarray
    key: str
    needle_start: int
    needle_len: int
    digits: tuple[np.ndarray, np.ndarray]
    question_len: int
    context_start: int = 0
    expected: tuple[str, ...] = ()  # a task kind's expected answers (kinds.py); () passkey
    placed: float | None = None  # a task kind's anchor depth in the filler (kinds.py)
    kind: str = "passkey"
    recall: tuple[int, ...] = ()  # decode_recall's question, after the generated tokens

    @property
    def needs_all(self) -> bool:
        """Whether the answer needs every span of ``digits`` (a task kind's needed values)
        rather than one of them (the passkey's two occurrences of one key)."""
        return bool(self.expected)

    @property
    def depth(self) -> float:
        """The needle's actual relative depth in the haystack (0: first, 1: last)."""
        if self.placed is not None:
            return self.placed
        room = self.ids.size - self.context_start - self.question_len - self.needle_len
        return (self.needle_start - self.context_start) / room if room > 0 else 0.0


@dataclass(frozen=True)
class Frame:
    """What comes before and after the haystack in every prompt of one model and format:
    ``head`` (special tokens, chat turn, task description) and ``question`` ids."""

    head: tuple[int, ...]
    question: tuple[int, ...]


def specials(tokenizer) -> list[int]:
    """The ids the tokenizer puts before a whole text (``<bos>`` for Gemma-3; none for
    SmolLM2), found by encoding one text with and without its special tokens; the ones it
    would put after (an end of sequence) do not belong in a prompt that goes on."""
    bare = encode(tokenizer, DESCRIPTION)
    whole = list(tokenizer(DESCRIPTION, add_special_tokens=True)["input_ids"])
    for k in range(len(whole) - len(bare) + 1):
        if whole[k:k + len(bare)] == bare:
            return whole[:k]
    raise ValueError("the tokenizer encodes a text differently with its special tokens")


def frame(tokenizer, prompt: str = "raw", description: str = DESCRIPTION, ask: str = ASK,
          answer: str = ANSWER) -> Frame:
    """The :class:`Frame` of ``prompt``: ``"raw"`` (the tokenizer's special tokens, the task
    ``description``, the haystack, ``ask + " " + answer``: :data:`QUESTION`) or ``"chat"``
    (the model's chat template around one user turn holding the description, the haystack
    and ``ask``; the model's turn then starts with ``answer``, "The pass key is")."""
    head = encode(tokenizer, description)
    if prompt == "raw":
        return Frame(tuple(specials(tokenizer) + head),
                     tuple(encode(tokenizer, f"{ask} {answer}")))
    if prompt != "chat":
        raise ValueError(f"prompt: expected one of {', '.join(PROMPTS)}, got {prompt!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("prompt = \"chat\": the model's tokenizer has no chat template")
    mark = "\x00HAYSTACK\x00"
    turn = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    before, after = turn.split(mark)
    return Frame(tuple(encode(tokenizer, before) + head),
                 tuple(encode(tokenizer, ask) + encode(tokenizer, after)
                       + encode(tokenizer, answer)))


def trial_rng(seed: int, length: int, depth: float, trial: int) -> np.random.Generator:
    """The generator of one trial: a function of the seed and the cell, not of the grid."""
    return np.random.default_rng((seed, length, int(round(depth * 1_000_000)), trial))


def encode(tokenizer, text: str) -> list[int]:
    """The ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def seeded_filler(tokenizer, rng: np.random.Generator, tokens: int) -> list[int]:
    """``tokens`` ids of sentences drawn uniformly from :data:`SENTENCES` by ``rng``."""
    encoded = [encode(tokenizer, " " + s) for s in SENTENCES]
    ids: list[int] = []
    while len(ids) < tokens:
        ids += encoded[int(rng.integers(len(SENTENCES)))]
    return ids[:tokens]


def text_filler(text_ids: np.ndarray, rng: np.random.Generator, tokens: int) -> list[int]:
    """``tokens`` consecutive ids of a tokenised text from a seeded offset."""
    if text_ids.size < tokens:
        raise ValueError(f"the text has {text_ids.size} tokens, fewer than {tokens}")
    start = int(rng.integers(0, text_ids.size - tokens + 1))
    return text_ids[start:start + tokens].tolist()


def boundaries(tokenizer, ids: list[int]) -> np.ndarray:
    """Positions ``a`` where a sentence may start: 0, and after every token ending in '.'."""
    ends = [i + 1 for i, t in enumerate(tokenizer.convert_ids_to_tokens(ids))
            if t.rstrip().endswith(".")]
    return np.array([0, *ends], np.int64)


def build(tokenizer, length: int, depth: float, rng: np.random.Generator,
          text_ids: np.ndarray | None = None, form: Frame | None = None) -> Prompt:
    """The prompt of one trial (see the module's docstring); ``text_ids``: the tokenised
    shipped text, or None for seeded sentences; ``form``: the model's :class:`Frame`
    (default: the raw one)."""
    form = form or frame(tokenizer)
    key = str(int(rng.integers(10000, 100000)))
    pieces = [" The pass key is", " " + key, ". Remember it.", " " + key, " is the pass key."]
    encoded = [encode(tokenizer, p) for p in pieces]
    needle = [i for piece in encoded for i in piece]
    head, question = list(form.head), list(form.question)
    room = length - len(head) - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a prompt of {length} tokens has no room for the filler (the "
                         f"description, needle and question take {length - room + 1})")
    filler = seeded_filler(tokenizer, rng, room) if text_ids is None \
        else text_filler(text_ids, rng, room)
    cuts = boundaries(tokenizer, filler)
    at = int(cuts[np.argmin(np.abs(cuts - depth * room))])
    ids = np.array(head + filler[:at] + needle + filler[at:] + question, np.int64)
    start = len(head) + at
    offsets = np.cumsum([0, *map(len, encoded)])
    digits = tuple(
        start + offsets[i] + np.array([j for j, t in enumerate(encoded[i])
                                       if re.search(r"\d", tokenizer.decode([t]))], np.int64)
        for i in (1, 3))
    return Prompt(ids, key, start, len(needle), digits, len(question), len(head))


def first_number(text: str) -> str | None:
    """The first 5-digit number of ``text`` (a maximal run of exactly 5 digits), or None."""
    match = re.search(r"(?<!\d)\d{5}(?!\d)", text)
    return match.group() if match else None
