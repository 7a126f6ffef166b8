"""The exact full-attention pass: one streaming sweep over the rows of one head.

It computes everything the policies and metrics need from the full field: row
statistics (max and sum of ``exp(l - max)``), column sums of the prompt rows and of
the decode rows, each decode row's total probability (the ``full`` policy's mass), and
the full-attention output ``o(t)`` of each decode row where the field has values.
Memory is O(T) per head (plus a fixed number of block buffers). Rows are dealt
round-robin to a fixed number of blocks, summed in row order within a block and
reduced in block order, so the result is identical for any thread count.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
from tqdm import tqdm

from kvsim.numerics.jit import jit, jit_inline, threads as kernel_threads
from kvsim.numerics.elementary import exp_nonpositive
from kvsim.numerics.field import FieldData, logits_span
from kvsim.numerics.lanes import (combine_max, combine_sum, lane_max_span, lane_sum,
                                  lane_sum_span)

BLOCKS = 16
LONG_PASS = 2**31  # logit evaluations of a pass that shows its progress (a few seconds)
SERIAL_ENTRIES = 1 << 23  # below this many entries, threads cost more than they save
SPAN = 2048  # keys of a row swept at once (16 KB of logits: they stay in L1 between loops)


class FullPass(NamedTuple):
    """What one full pass over a head yields (``steps = T - prompt_len``)."""

    row_max: np.ndarray        # (T,) float64
    row_sum: np.ndarray        # (T,) float64
    prompt_colsum: np.ndarray  # (T,) float64: sum over q < P of p(q, k)
    decode_colsum: np.ndarray  # (T,) float64: sum over q >= P of p(q, k)
    full_output: np.ndarray    # (steps, dv) float64: o(t), or (steps, 0)
    decode_mass: np.ndarray    # (steps,) float64: sum over k of p(t, k), for t >= P


@jit
def exp_shifted(x, lo, hi, top):
    """Replace ``x[lo:hi]`` by ``exp(x - top)`` (``x <= top``): a loop of its own, so that
    it vectorises."""
    span = x[lo:hi]  # indices from 0: LLVM then vectorises the loop
    for k in range(hi - lo):
        span[k] = exp_nonpositive(span[k] - top)


@jit
def row_exp(f, h, q, n, keys, buf, work, lanes):
    """``exp(l - max)`` of row ``q`` of a component field into ``buf[:n]``; returns the
    row's ``(max, sum of exp(l - max))``. Two sweeps over the row, span by span (``lanes``:
    scratch for 8 floats): logits and their maximum, then exp and its sum. The same numbers
    as logits, :func:`lane_max`, exp and :func:`lane_sum` one after another over the whole
    row (the lanes see the same elements in the same order)."""
    for lo in range(0, n, SPAN):
        hi = min(lo + SPAN, n)
        logits_span(f, h, q, keys, lo, hi, buf, work)
        if lo == 0:
            lanes[:] = buf[0]
        lane_max_span(buf, lo, hi, lanes)
    top = combine_max(lanes)
    lanes[:] = 0.0
    for lo in range(0, n, SPAN):
        hi = min(lo + SPAN, n)
        exp_shifted(buf, lo, hi, top)
        lane_sum_span(buf, lo, hi, lanes)
    return top, combine_sum(lanes)


@jit_inline
def _add_output(f, kv, q, n, prompt_len, buf, full_output):
    """The full-attention output ``o(q)`` of a decode row from its probabilities ``buf[:n]``
    (where the field has values)."""
    dv = full_output.shape[1]
    if q >= prompt_len and dv > 0:
        output = full_output[q - prompt_len]
        for k in range(n):
            value = f.values[kv, k]  # row views: LLVM then vectorises over i
            for i in range(dv):
                output[i] += buf[k] * value[i]


@jit
def _full_pass_block(f, h, prompt_len, rows, b, row_max, row_sum, prompt_sums, decode_sums,
                     full_output, decode_mass):
    """Rows ``b, b + BLOCKS, ...`` below ``rows`` of a component field (``b`` may start
    past the block's first row, to run its rows span by span): column sums into this
    block's own ``prompt_sums``/``decode_sums``; per-row outputs at the block's own rows
    only, so blocks can run on any threads at once."""
    T = f.key_bias.shape[1]
    kv = h // f.group
    keys = np.arange(T)
    buf = np.empty(T)
    work = np.empty(T)
    lanes = np.empty(8)
    for q in range(b, rows, BLOCKS):
        n = q + 1
        target = prompt_sums if q < prompt_len else decode_sums
        top, total = row_exp(f, h, q, n, keys, buf, work, lanes)
        row_max[q] = top
        row_sum[q] = total
        # The same expression as probs_at, so every path sees identical numbers.
        scale = 1.0 / total
        lanes[:] = 0.0
        for lo in range(0, n, SPAN):  # the third sweep: probabilities, column sums, mass
            hi = min(lo + SPAN, n)
            probs, sums = buf[lo:hi], target[lo:hi]
            for k in range(hi - lo):
                probs[k] = probs[k] * scale
                sums[k] += probs[k]
            if q >= prompt_len:
                lane_sum_span(buf, lo, hi, lanes)
        if q >= prompt_len:
            decode_mass[q - prompt_len] = combine_sum(lanes)
        _add_output(f, kv, q, n, prompt_len, buf, full_output)


@jit
def _dense_block(f, h, prompt_len, rows, b, row_max, row_sum, prompt_sums, decode_sums,
                 full_output, decode_mass):
    """:func:`_full_pass_block` of a dense field: its rows read, not computed (a kernel of
    its own, so that a run over dense matrices compiles none of the logit code)."""
    T = f.key_bias.shape[1]
    kv = h // f.group
    buf = np.empty(T)
    for q in range(b, rows, BLOCKS):
        n = q + 1
        if q < prompt_len:  # only the column sums: no copy of the row
            row = f.probs[h, q]
            for k in range(n):
                prompt_sums[k] += row[k]
            continue
        for k in range(n):
            buf[k] = f.probs[h, q, k]
            decode_sums[k] += buf[k]
        decode_mass[q - prompt_len] = lane_sum(buf, n)
        _add_output(f, kv, q, n, prompt_len, buf, full_output)


def block_kernel(dense: bool):
    """The kernel that runs a block of the full pass of a dense or a component field."""
    return _dense_block if dense else _full_pass_block


@jit
def dense_prompt_colsum(probs, h, rows):
    """Column sums of rows ``0 .. rows-1`` of head ``h`` of a dense matrix, summed as the
    blocks of :func:`_full_pass_block` sum them (rows dealt round-robin to ``BLOCKS``
    blocks, each summed in row order, the blocks added in block order): the same numbers,
    in one call."""
    T = probs.shape[2]
    out = np.zeros(T)
    block = np.empty(T)
    for b in range(BLOCKS):
        for k in range(rows):
            block[k] = 0.0
        for q in range(b, rows, BLOCKS):
            row = probs[h, q]
            for k in range(q + 1):
                block[k] += row[k]
        for k in range(rows):
            out[k] += block[k]
    return out


def full_pass(field: FieldData, head: int, prompt_len: int, rows: int | None = None,
              progress: bool = False) -> FullPass:
    """Run the full pass of query head ``head`` with prompt length ``prompt_len``.

    ``rows`` limits the pass to queries ``0 .. rows-1`` (a dense field that only needs
    prompt column sums); each block still sums its rows in the same order, so a partial
    pass gives bit-identical prompt sums. A pass of more than ``LONG_PASS`` logit
    evaluations runs each block's rows span by span, in the same order (the same
    numbers), so that an interrupt (Ctrl-C, SIGTERM) stops it within a span, and, with
    ``progress``, shows the logits done out of the total on stderr (a row's cost grows
    with its length, so counting rows would promise an early end).
    """
    T = field.T
    rows = T if rows is None else rows
    dv = field.values.shape[2] if field.has_values(head // field.group) else 0
    row_max = np.zeros(T)
    row_sum = np.ones(T)
    full_output = np.zeros((T - prompt_len, dv))
    decode_mass = np.zeros(T - prompt_len)
    threads = min(kernel_threads(), BLOCKS)
    serial = threads == 1 or rows * (rows + 1) // 2 < SERIAL_ENTRIES
    if field.is_dense and rows <= prompt_len and serial:  # the prompt's column sums alone
        return FullPass(row_max, row_sum, dense_prompt_colsum(field.probs, head, rows),
                        np.zeros(T), full_output, decode_mass)
    prompt_blocks = np.zeros((BLOCKS, T))
    decode_blocks = np.zeros((BLOCKS, T))

    long = rows * (rows + 1) / 2 > LONG_PASS
    span = max(BLOCKS, rows // 200 // BLOCKS * BLOCKS) if long else max(rows, 1)
    bar = tqdm(total=rows * (rows + 1) // 2, unit="logit", unit_scale=True,
               desc=f"full pass, head {head}", leave=False, disable=not (progress and long),
               dynamic_ncols=True)
    stop = threading.Event()  # set when the caller is interrupted: the blocks end early
    kernel = block_kernel(field.is_dense)

    def block(b: int) -> None:  # the kernel releases the GIL: blocks run in parallel
        for lo in range(0, rows, span):
            if stop.is_set():
                return
            end = min(lo + span, rows)
            kernel(field, head, prompt_len, end, lo + b, row_max, row_sum,
                   prompt_blocks[b], decode_blocks[b], full_output, decode_mass)
            done = range(lo + b + 1, end + 1, BLOCKS)  # the lengths of the rows just done
            bar.update(len(done) * (done.start + done[-1]) // 2 if done else 0)

    with bar:
        if serial:
            for b in range(BLOCKS):  # the same blocks in the same order: identical sums
                block(b)
        else:
            with ThreadPoolExecutor(threads) as pool:
                try:
                    list(pool.map(block, range(BLOCKS)))
                except BaseException:  # KeyboardInterrupt: stop the threads before waiting
                    stop.set()
                    raise
    return FullPass(row_max, row_sum, _reduce(prompt_blocks), _reduce(decode_blocks),
                    full_output, decode_mass)


def _reduce(blocks: np.ndarray) -> np.ndarray:
    """Sum the block buffers in block order (a fixed order: thread-count independent)."""
    out = blocks[0].copy()
    for b in range(1, blocks.shape[0]):
        out += blocks[b]
    return out
