"""RULER's needle family as task kinds: each kind defined once, deterministic from the seed.

The facts follow RULER (NVIDIA/RULER at commit c3f5e3b4, scripts/synthetic.yaml,
scripts/data/synthetic/{niah,variable_tracking,constants}.py, scripts/eval/synthetic/
constants.py); the code is kvsim's own:

- ``niah_single`` (RULER's niah_single_2): one needle "One of the special magic numbers for
  KEY is: VALUE." (KEY an adjective-noun word, VALUE a 7-digit number), the question asks
  for KEY's value;
- ``niah_multikey`` (niah_multikey_1): four needles with four keys, one asked (three
  distractors);
- ``niah_multivalue`` (niah_multivalue): one key with four needles of four values, all asked;
- ``niah_multiquery`` (niah_multiquery): four keys, all four asked in one question;
- ``vt`` (vt: one chain of four hops): "VAR A = 12345." then "VAR B = VAR A." ... four
  times; asked for every variable assigned the value, after one worked example of the same
  form (RULER's in-context example, here over a short filler of six sentences);
- ``decode_recall`` (kvsim's, on niah_single's needle): the prompt ends with a first,
  unrelated task (:data:`FIRST`) instead of the question; the model generates the task
  file's ``generate_tokens`` tokens of its own, then niah_single's question (the Prompt's
  ``recall``) comes and the answer is scored: per-step eviction during the generation
  decides whether the needle survives.

Prompts: RULER's template (its description, the context, its question) with its answer
prefix after the question, in the model's own format (:func:`kvsim.tools.task.inputs.frame`:
its special tokens; ``chat``: the chat template around the user turn, the answer prefix
opening the model's turn); the haystack is the task file's filler (``seeded`` sentences, as
RULER's ``noise``, or a shipped text cut at a seeded offset, in place of RULER's essays).
The first needle asked (vt: the chain's first assignment) sits at the trial's depth, at the
filler's sentence boundary nearest to it; every other needle at a boundary drawn by the
trial's generator (vt: after it, in the chain's order). Scoring as RULER: every kind here is
scored by ``string_match_all`` (the share of the expected values the answer contains, case
aside); a trial succeeds when it is 1. Answers are RULER's ``tokens_to_generate``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from kvsim.errors import KvsimError
from kvsim.tools.task import inputs

PASSKEY = "passkey"
ADJECTIVES = (
    "ancient", "bitter", "brave", "bright", "calm", "clever", "crimson", "curious", "damp",
    "eager", "fancy", "fierce", "gentle", "golden", "hollow", "humble", "icy", "jolly",
    "lazy", "lively", "lucky", "mellow", "misty", "noisy", "odd", "pale", "polite", "quiet",
    "rapid", "rusty", "shiny", "silent", "sleepy", "smooth", "sour", "steady", "tidy",
    "tiny", "wild", "witty")
NOUNS = (
    "anchor", "badge", "barrel", "basket", "beacon", "bishop", "blanket", "bridge", "button",
    "candle", "canyon", "castle", "cellar", "chimney", "compass", "cottage", "dragon",
    "falcon", "feather", "garden", "harbor", "helmet", "island", "jacket", "kettle",
    "ladder", "lantern", "meadow", "mirror", "orchard", "parrot", "pepper", "pillow",
    "puzzle", "rocket", "saddle", "tunnel", "violin", "wagon", "walnut")
NIAH_NEEDLE = "One of the special magic numbers for {key} is: {value}."
NIAH_DESCRIPTION = ("Some special magic numbers are hidden within the following text. Make "
                    "sure to memorize it. I will quiz you about the numbers afterwards.\n")
NIAH_ASK = "\nWhat are all the special magic numbers for {query} mentioned in the provided text?"
NIAH_ANSWER = "The special magic numbers for {query} mentioned in the provided text are"
VT_DESCRIPTION = ("Memorize and track the chain(s) of variable assignment hidden in the "
                  "following text.\n\n")
VT_ASK = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER = ("Answer: According to the chain(s) of variable assignment in the text above, "
             "{count} variables are assigned the value {query}, they are: ")
VT_EXAMPLE_FILLER = 6  # sentences of the worked example's filler
FIRST = "\nBefore the question, an unrelated task: write a short story.\nStory:"
DECODE_RECALL = "decode_recall"  # the kind whose question comes after generated tokens


@dataclass(frozen=True)
class Kind:
    """One task kind: RULER's task it follows, its needles (``keys`` keys of ``values``
    values each, ``queries`` keys asked; vt: one chain of ``hops`` hops), the tokens
    generated and the metric; ``first``: a first task that ends the prompt, answered by the
    model's own tokens before the question comes (decode_recall)."""

    name: str
    ruler: str
    keys: int = 1
    values: int = 1
    queries: int = 1
    hops: int = 0
    tokens: int = 128
    metric: str = "string_match_all"
    first: str = ""


KINDS = {k.name: k for k in (
    Kind("niah_single", "niah_single_2"),
    Kind("niah_multikey", "niah_multikey_1", keys=4),
    Kind("niah_multivalue", "niah_multivalue", values=4),
    Kind("niah_multiquery", "niah_multiquery", keys=4, queries=4),
    Kind("vt", "vt", hops=4, tokens=30),
    Kind(DECODE_RECALL, "niah_single_2", first=FIRST),
)}
NAMES = (PASSKEY, *KINDS)


def require_passkey(cfg, why: str) -> None:
    """A one-line :class:`KvsimError` unless the task file ``cfg`` is of the passkey kind
    (``why``: what needs it, in the message)."""
    if cfg.kind != PASSKEY:
        raise KvsimError(f"{cfg.path}: task.kind: expected 'passkey' ({why}), got "
                         f"{cfg.kind!r}")


def string_match_all(answer: str, expected: tuple[str, ...]) -> float:
    """RULER's ``string_match_all``: the share of ``expected`` found in ``answer`` (case
    aside)."""
    text = answer.lower()
    return sum(e.lower() in text for e in expected) / len(expected)


def string_match_part(answer: str, expected: tuple[str, ...]) -> float:
    """RULER's ``string_match_part``: 1 if any of ``expected`` is in ``answer`` (case
    aside), else 0."""
    text = answer.lower()
    return float(any(e.lower() in text for e in expected))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score(kind: str, answer: str, expected: tuple[str, ...]) -> dict:
    """The score columns of one answer: both RULER metrics, and success (the kind's metric
    is 1)."""
    scores = {name: fn(answer, expected) for name, fn in METRICS.items()}
    return {"success": int(scores[KINDS[kind].metric] == 1.0),
            "score_all": scores["string_match_all"], "score_part": scores["string_match_part"]}


@dataclass(frozen=True)
class Needle:
    """One sentence planted in the haystack: its text pieces, the piece that holds what the
    answer needs (``None``: the whole sentence) and whether the answer needs it."""

    pieces: tuple[str, ...]
    value: int | None
    needed: bool


@dataclass(frozen=True)
class Content:
    """One trial's texts: the description, the needles (the first needed one is the
    anchor at the depth), the question and the answer prefix, the expected answers;
    ``ordered``: the needles keep their order after the anchor (a chain); ``first``: the
    first task that ends the prompt, the question then coming after generated tokens."""

    description: str
    needles: tuple[Needle, ...]
    ask: str
    answer: str
    expected: tuple[str, ...]
    ordered: bool = False
    first: str = ""


def _words(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct adjective-noun keys (RULER's key form)."""
    out: list[str] = []
    while len(out) < n:
        word = f"{ADJECTIVES[int(rng.integers(len(ADJECTIVES)))]}-" \
               f"{NOUNS[int(rng.integers(len(NOUNS)))]}"
        if word not in out:
            out.append(word)
    return out


def _numbers(rng: np.random.Generator, n: int) -> list[str]:
    """``n`` distinct 7-digit numbers (RULER's values)."""
    out: list[str] = []
    while len(out) < n:
        value = str(int(rng.integers(1_000_000, 10_000_000)))
        if value not in out:
            out.append(value)
    return out


def _plural(text: str, single: bool) -> str:
    """RULER's wording when one value is asked: "Some" -> "A", "are all" -> "is", "are" ->
    "is", "numbers" -> "number"."""
    if not single:
        return text
    for old, new in (("Some", "A"), ("are all", "is"), ("are", "is"), ("numbers", "number")):
        text = text.replace(old, new)
    return text


def niah(kind: Kind, rng: np.random.Generator) -> Content:
    """The texts of one needle-in-a-haystack trial of ``kind``."""
    keys = _words(rng, kind.keys)
    values = [_numbers(rng, kind.values) for _ in keys]
    asked = sorted(int(i) for i in rng.choice(kind.keys, kind.queries, replace=False))
    needles = [Needle((" One of the special magic numbers for", " " + key, " is:", " " + v, "."),
                      3, i in asked)
               for i, key in enumerate(keys) for v in values[i]]
    needles.sort(key=lambda n: not n.needed)  # the first needed needle first: the anchor
    query = keys[asked[0]] if len(asked) == 1 else \
        ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]]
    single = kind.queries * kind.values == 1
    return Content(_plural(NIAH_DESCRIPTION, single), tuple(needles),
                   _plural(NIAH_ASK, single).format(query=query),
                   _plural(NIAH_ANSWER, single).format(query=query),
                   tuple(v for i in asked for v in values[i]), first=kind.first)


def _chain(rng: np.random.Generator, hops: int) -> tuple[list[str], str, list[str]]:
    """A chain of ``hops`` assignments: its variables (five capital letters each), its
    value (5 digits) and its statements in order."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(chr(65 + int(c)) for c in rng.integers(0, 26, 5))
        if name not in names:
            names.append(name)
    value = str(int(rng.integers(10000, 99999)))
    statements = [f"VAR {names[0]} = {value}."] + \
        [f"VAR {names[j + 1]} = VAR {names[j]}." for j in range(hops)]
    return names, value, statements


def vt(kind: Kind, rng: np.random.Generator) -> Content:
    """The texts of one variable-tracking trial: a worked example (its own chain among
    :data:`VT_EXAMPLE_FILLER` seeded sentences, then its answer), then the task."""
    names, value, statements = _chain(rng, kind.hops)
    ex_names, ex_value, ex_statements = _chain(rng, kind.hops)
    filler = [inputs.SENTENCES[int(i)] for i in rng.integers(len(inputs.SENTENCES),
                                                              size=VT_EXAMPLE_FILLER)]
    at = sorted(int(i) for i in rng.choice(VT_EXAMPLE_FILLER + 1, kind.hops + 1))
    lines = list(filler)
    for j, s in enumerate(ex_statements):
        lines.insert(at[j] + j, s)
    example = (VT_DESCRIPTION + " ".join(lines)
               + VT_ASK.format(query=ex_value) + " "
               + VT_ANSWER.format(count=kind.hops + 1, query=ex_value) + " ".join(ex_names)
               + "\n\n")
    return Content(example + VT_DESCRIPTION,
                   tuple(Needle((" " + s,), None, True) for s in statements),
                   VT_ASK.format(query=value),
                   VT_ANSWER.format(count=kind.hops + 1, query=value), tuple(names),
                   ordered=True)


def content(kind: str, rng: np.random.Generator) -> Content:
    """The texts of one trial of ``kind``."""
    k = KINDS[kind]
    return vt(k, rng) if k.hops else niah(k, rng)


def _span(tokenizer, encoded: list[list[int]], needle: Needle, start: int) -> np.ndarray:
    """The positions of what the answer needs in a needle placed at ``start``: the value
    piece's tokens that hold a digit, or the whole sentence."""
    offsets = np.cumsum([0, *map(len, encoded)])
    if needle.value is None:
        return np.arange(start, start + offsets[-1], dtype=np.int64)
    piece = encoded[needle.value]
    return start + offsets[needle.value] + np.array(
        [j for j, t in enumerate(piece) if re.search(r"\d", tokenizer.decode([t]))], np.int64)


def build(kind: str, tokenizer, length: int, depth: float, rng: np.random.Generator,
          text_ids: np.ndarray | None = None, prompt: str = "raw") -> inputs.Prompt:
    """The prompt of one trial of ``kind`` (see the module's docstring), exactly ``length``
    tokens: ``head + filler with the needles + question``; the Prompt's ``digits`` are the
    needed spans (every one must be held), ``key`` the expected answers joined by spaces.
    A kind with a first task (decode_recall; ``raw`` only) ends the prompt with it, its
    question is the Prompt's ``recall``."""
    c = content(kind, rng)
    if c.first and prompt != "raw":
        raise ValueError(f"prompt: expected 'raw' for {kind}, got {prompt!r}")
    form = inputs.frame(tokenizer, prompt, c.description, c.ask, c.answer)
    encoded = [[inputs.encode(tokenizer, p) for p in n.pieces] for n in c.needles]
    flat = [[i for piece in e for i in piece] for e in encoded]
    head, question = list(form.head), list(form.question)
    recall = ()
    if c.first:  # the first task ends the prompt; the question comes after generation
        recall, question = tuple(question), inputs.encode(tokenizer, c.first)
    room = length - len(head) - sum(map(len, flat)) - len(question)
    if room < 1:
        raise ValueError(f"a prompt of {length} tokens has no room for the filler (the "
                         f"description, needles and question take {length - room + 1})")
    filler = inputs.seeded_filler(tokenizer, rng, room) if text_ids is None \
        else inputs.text_filler(text_ids, rng, room)
    cuts = inputs.boundaries(tokenizer, filler)
    anchor = int(cuts[np.argmin(np.abs(cuts - depth * room))])
    later = cuts[cuts >= anchor] if c.ordered else cuts
    others = rng.choice(later, len(c.needles) - 1)
    at = [anchor, *(sorted(others) if c.ordered else others)]
    order = sorted(range(len(at)), key=lambda i: (at[i], i))  # the anchor first at its cut
    ids, last, starts = list(head), 0, {}
    for i in order:
        ids += filler[last:at[i]]
        last = int(at[i])
        starts[i] = len(ids)
        ids += flat[i]
    ids += filler[last:] + question
    spans = [_span(tokenizer, encoded[i], n, starts[i]) for i, n in enumerate(c.needles)
             if n.needed]
    return inputs.Prompt(np.array(ids, np.int64), " ".join(c.expected), starts[0], len(flat[0]),
                         tuple(spans), len(question), len(head), expected=c.expected,
                         placed=anchor / room, kind=kind, recall=recall)
