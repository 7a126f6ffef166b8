"""The question protocol (DESIGN section 9, ``question_len`` and ``compress``), in one place.

A prompt of ``P`` tokens ends with a question of ``Q`` tokens.

- ``after_question`` (query-aware): prefill the whole prompt with full attention, then the
  policy compresses to ``B`` from the prompt queries ``< P``; decode under budget ``B``.
- ``before_question`` (query-agnostic, kvpress's default): prefill the context ``< P - Q``
  with full attention and compress to ``B`` from the queries ``< P - Q`` only; then the
  question's ``Q`` keys join **without eviction**, their queries attend over the compressed
  cache and the policy observes them as at decode; the decode budget is ``B + Q`` (the
  peak), while the policy's fixed parts (recent tokens, sinks, windows) stay those of ``B``.
- ``prefill_only`` (kvpress's own protocol; tasks only): compress the context ``< P - Q``
  once, as ``before_question`` does; then the question and every answer token join
  **without eviction** (peak ``B + Q + answer``). A simulated decode has no end, so the
  simulator does not take it: a cache that never evicts over a long decode is the full one.

:func:`plan` says where each protocol compresses and how many keys join freely;
:func:`kvsim.policies.layout.widen` gives a policy's step state the ``Q`` extra slots of
``before_question``. Both the closed loop (``kvsim task``) and the simulator use these
definitions.
"""

from __future__ import annotations

from typing import NamedTuple

from kvsim.errors import KvsimError
from kvsim.params import Param
from kvsim.protocols.base import Protocol

COMPRESS = ("before_question", "after_question")
TASK_COMPRESS = (*COMPRESS, "prefill_only")  # a task's answer ends; a simulated decode does not


class Plan(NamedTuple):
    """Where a prompt is compressed under a protocol.

    ``compress_at``: the prompt length the policy's prefill sees (its queries and keys are
    positions ``< compress_at``); ``free``: the tokens ``compress_at .. compress_at + free - 1``
    that then join without eviction (the question); ``budget``: the decode budget (the
    peak number of cached keys).
    """

    compress_at: int
    free: int
    budget: int


def plan(compress: str, prompt_len: int, question_len: int, budget: int,
         answer: int = 0) -> Plan:
    """The :class:`Plan` of ``compress`` for a prompt of ``prompt_len`` tokens whose last
    ``question_len`` are the question, at budget ``budget``; ``answer``: the tokens that
    join after the prompt (``prefill_only`` holds them all)."""
    if compress not in TASK_COMPRESS:
        raise KvsimError(f"compress: expected one of {', '.join(TASK_COMPRESS)}, got "
                         f"{compress!r}")
    if not 0 <= question_len <= prompt_len:
        raise KvsimError(f"question_len: expected an integer in [0, {prompt_len}], got "
                         f"{question_len!r}")
    if compress == "prefill_only":
        free = question_len + answer
        return Plan(prompt_len - question_len, free, budget + free)
    if compress == "after_question" or question_len == 0:
        return Plan(prompt_len, 0, budget)
    return Plan(prompt_len - question_len, question_len, budget + question_len)


def before_question(proto: dict) -> int:
    """The question length ``Q`` that joins without eviction (0 after the question)."""
    return proto["question_len"] if proto["compress"] == "before_question" else 0


PROTOCOL = Protocol(
    "question_len",
    params={
        "question_len": Param(int, 0, "the prompt's last Q tokens are the question", low=0,
                              high=2**31, expect="an integer >= 0"),
        "compress": Param(str, "after_question", "compress the prompt before or after the "
                          "question", choices=COMPRESS),
    },
    asked=lambda proto: "question_len" if before_question(proto) else None,
    label=lambda proto: f"before_question(Q={proto['question_len']})",
    extra=before_question,
    combines=("interval",),
)
"""The question changes only the prompt the policy compresses (:func:`plan`); the decode
is the per-step rule's, or that of the protocol it combines with."""
