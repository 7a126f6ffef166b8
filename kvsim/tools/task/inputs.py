"""The passkey inputs: deterministic from the seed, no download.

A prompt of exactly ``n`` tokens (the model's tokenizer, no special tokens added) is

    filler[:a] + needle + filler[a:] + question

- ``needle``: " The pass key is NNNNN. Remember it. NNNNN is the pass key." (the key a
  5-digit number drawn from the trial's seed);
- ``question``: "\\nWhat is the pass key? The pass key is" (its ``Q`` tokens are the
  question of the protocols);
- ``filler``: ``n - Q - len(needle)`` tokens of haystack, either sentences drawn from a
  fixed list (the classic passkey haystack) by a NumPy generator seeded with the trial's
  seed (``seeded``), or a text shipped with kvsim cut at a seeded offset;
- ``a``: the filler's sentence boundary (a position after a token ending in ".", or 0)
  nearest to ``d * len(filler)``: the needle's relative depth is ``d`` up to half a
  sentence.

Each piece is tokenised on its own and the ids concatenated, so the counts are exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

QUESTION = "\nWhat is the pass key? The pass key is"
SENTENCES = (  # the classic passkey haystack (Mohtashami and Jaggi 2023), and three alike
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
    "There and back again.", "The river is wide.", "The night is dark.", "The road is long.")


@dataclass(frozen=True)
class Prompt:
    """One trial's prompt: ``ids`` (n,) int64; the key; the needle's first position and
    the positions of the key's digit tokens, one array per occurrence; the question's
    length ``Q`` (the prompt's last ``Q`` tokens)."""

    ids: np.ndarray
    key: str
    needle_start: int
    needle_len: int
    digits: tuple[np.ndarray, np.ndarray]
    question_len: int

    @property
    def depth(self) -> float:
        """The needle's actual relative depth in the context (0: first, 1: last)."""
        room = self.ids.size - self.question_len - self.needle_len
        return self.needle_start / room if room > 0 else 0.0


def trial_rng(seed: int, length: int, depth: float, trial: int) -> np.random.Generator:
    """The generator of one trial: a function of the seed and the cell, not of the grid."""
    return np.random.default_rng((seed, length, int(round(depth * 1_000_000)), trial))


def _encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def seeded_filler(tokenizer, rng: np.random.Generator, tokens: int) -> list[int]:
    """``tokens`` ids of sentences drawn uniformly from :data:`SENTENCES` by ``rng``."""
    encoded = [_encode(tokenizer, " " + s) for s in SENTENCES]
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
          text_ids: np.ndarray | None = None) -> Prompt:
    """The prompt of one trial (see the module's docstring); ``text_ids``: the tokenised
    shipped text, or None for seeded sentences."""
    key = str(int(rng.integers(10000, 100000)))
    pieces = [" The pass key is", " " + key, ". Remember it.", " " + key, " is the pass key."]
    encoded = [_encode(tokenizer, p) for p in pieces]
    needle = [i for piece in encoded for i in piece]
    question = _encode(tokenizer, QUESTION)
    room = length - len(needle) - len(question)
    if room < 1:
        raise ValueError(f"a prompt of {length} tokens has no room for the filler")
    filler = seeded_filler(tokenizer, rng, room) if text_ids is None \
        else text_filler(text_ids, rng, room)
    cuts = boundaries(tokenizer, filler)
    at = int(cuts[np.argmin(np.abs(cuts - depth * room))])
    ids = np.array(filler[:at] + needle + filler[at:] + question, np.int64)
    offsets = np.cumsum([0, *map(len, encoded)])
    digits = tuple(
        at + offsets[i] + np.array([j for j, t in enumerate(encoded[i])
                                    if re.search(r"\d", tokenizer.decode([t]))], np.int64)
        for i in (1, 3))
    return Prompt(ids, key, at, len(needle), digits, len(question))


def first_number(text: str) -> str | None:
    """The first 5-digit number of ``text`` (a maximal run of exactly 5 digits), or None."""
    match = re.search(r"(?<!\d)\d{5}(?!\d)", text)
    return match.group() if match else None
