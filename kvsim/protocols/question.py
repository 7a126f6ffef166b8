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
:func:`widen` gives a policy's step state the ``Q`` extra slots of ``before_question``.
Both the closed loop (``kvsim task``) and the simulator use these definitions.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from kvsim.errors import KvsimError

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


def slot_fields(policy: str, params: dict) -> frozenset[str]:
    """The fields of ``policy``'s step state that hold one entry per cache slot (their last
    axis grows with the budget), found once on a tiny prompt at two budgets."""
    key = (policy, tuple(sorted(params.items())))
    if key not in _SLOT_FIELDS:
        from kvsim.policies.run import get_policy, resolve_params
        from kvsim.policies.stepping import Stepper

        resolved = resolve_params(get_policy(policy), params)
        b = get_policy(policy).min_budget(resolved) + 2
        P, T, d = b + 9, b + 13, 5
        rng = np.random.default_rng(0)
        A = np.tril(rng.random((1, P, P)) + 0.1)
        A /= A.sum(axis=-1, keepdims=True)
        keys, values = rng.standard_normal((T, d)), rng.standard_normal((T, d + 2))
        queries = rng.standard_normal((1, T, d))
        rope = (rng.standard_normal((1, P, d)), np.array([1.0, 0.5]), 1.0)  # if needed
        small, large = (Stepper(policy, budget, params, prompt_attention=A, keys=keys,
                                values=values, queries=queries, capacity_T=T,
                                rope=rope)._state
                        for budget in (b, b + 1))
        _SLOT_FIELDS[key] = frozenset(
            name for name, value in small._asdict().items()
            if isinstance(value, np.ndarray) and value.ndim
            and getattr(large, name).shape[-1] == value.shape[-1] + 1)
    return _SLOT_FIELDS[key]


_SLOT_FIELDS: dict = {}


def widen(state: NamedTuple, slots: frozenset[str], budget: int, extra: int,
          seed: int) -> NamedTuple:
    """A copy of a policy's step state at ``budget`` with ``extra`` more cache slots, everything else as
    it was (the fixed parts stay those of the budget): the keys of the question then join
    without eviction (a step appends while the cache has room), and later steps evict
    from the ``budget + extra`` slots.

    ``slots`` names the per-slot fields (:func:`slot_fields`): they are padded with zeros
    along their last axis (a new slot holds no score, no vote, no pin). A ring (``base``,
    ``start``, ``width``) widens by ``extra``, so that its oldest key still leaves first;
    the ``random`` policy's evictions, drawn over the budget's slots, are drawn again
    uniformly over the wider cache (seeded by ``seed`` and ``extra``).
    """
    if extra <= 0:
        return state
    fields = state._asdict()
    for name in slots:
        value = fields[name]
        fields[name] = np.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, extra)])
    if {"base", "start", "width"} <= fields.keys():
        fields["width"] = int(fields["width"]) + extra
    if type(state).__module__ == "kvsim.policies.random_eviction":
        fields["slots"] = np.random.default_rng((seed, extra)).integers(
            0, budget + extra, size=fields["slots"].size).astype(np.int64)
    return type(state)(**fields)
