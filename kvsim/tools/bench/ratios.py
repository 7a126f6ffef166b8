"""The bench's ratio rows: each compares kvsim with a peer timed in the same run.

- the q.k full pass against the same work in NumPy: ``Q @ K.T`` (BLAS, float32, as a
  NumPy user would write it), a causal softmax and the column sums, over the same field;
- a scenario's warm run against the sum of its full passes at the bench's measured rate,
  so that the share of the run that is not the pass shows.
"""

from __future__ import annotations

import time
from pathlib import Path
from statistics import median

import numpy as np

from kvsim.attention import components
from kvsim.numerics.field import FieldData
from kvsim.numerics.fullpass import full_pass
from kvsim.scenario.load import load_scenario


def qk_field(T: int, d: int) -> FieldData:
    """One head whose logits are ``q.k / sqrt(d)`` alone (clustered keys, no values)."""
    comps = {"qk": {"dim": d, "clusters": 8, "spread": 0.5, "focus": 1, "strength": 1.0,
                    "values": False}, "boost": []}
    return components.build([comps], T, 1, seed=0)[0]


def numpy_qk_pass(Q: np.ndarray, K: np.ndarray, scale: float, prompt_len: int):
    """What the full pass yields for a q.k head, in NumPy: row max and sum, prompt and decode
    column sums."""
    T = Q.shape[0]
    L = Q @ K.T
    L *= L.dtype.type(scale)
    L[np.triu_indices(T, 1)] = -np.inf
    top = L.max(axis=1, keepdims=True)
    np.exp(L - top, out=L)
    total = L.sum(axis=1, keepdims=True)
    L /= total
    return top[:, 0], total[:, 0], L[:prompt_len].sum(axis=0), L[prompt_len:].sum(axis=0)


def qk_versus_numpy(T: int, d: int, repeats: int) -> dict:
    """kvsim's full pass on a q.k field against :func:`numpy_qk_pass`, timed in turn; the
    column sums are checked to agree (float32 NumPy against kvsim's float64)."""
    field = qk_field(T, d)
    P = T - T // 8
    Q, K = field.queries[0], np.ascontiguousarray(field.keys[0].T)
    scale = float(field.qk_scale[0])
    ours = full_pass(field, 0, P)
    theirs = numpy_qk_pass(Q, K, scale, P)
    if not np.allclose(ours.prompt_colsum, theirs[2], rtol=1e-3, atol=1e-3):
        raise AssertionError("bench: NumPy q.k pass and kvsim's full pass disagree")
    times: dict = {"kvsim": [], "numpy": []}
    for _ in range(repeats):  # in turn, so that load from elsewhere falls on both alike
        start = time.perf_counter()
        full_pass(field, 0, P)
        times["kvsim"].append(time.perf_counter() - start)
        start = time.perf_counter()
        numpy_qk_pass(Q, K, scale, P)
        times["numpy"].append(time.perf_counter() - start)
    kvsim_s, numpy_s = median(times["kvsim"]), median(times["numpy"])
    return {"T": T, "d": d, "kvsim_s": kvsim_s, "numpy_s": numpy_s,
            "speedup": numpy_s / kvsim_s, "logits_per_s": T * (T + 1) / 2 / kvsim_s}


def pass_floor(scenario: Path, rate: float) -> dict:
    """Seconds the full passes of ``scenario`` take at ``rate`` logit evaluations per
    second: one pass per (seed, layer, query head, prompt length)."""
    s = load_scenario(scenario)
    prompts = {e.prompt_len for e in s.experiments}
    passes = len(s.seeds) * len(s.layers) * s.heads * len(prompts)
    entries = passes * s.T * (s.T + 1) / 2
    return {"passes": passes, "T": s.T, "entries": entries, "seconds": entries / rate}
