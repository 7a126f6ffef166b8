"""Every registered policy's kernels on edge cases, meant to run with NUMBA_BOUNDSCHECK=1
(tests/test_boundscheck.py starts it in a subprocess with a fresh NUMBA_CACHE_DIR).

Two parts, both against the NumPy references (tests/reference.py):

- every policy and variant of the reference table on a small q.k field (exact ties in
  every other case), prompts 0, mid and T, budgets at the minimum (the fixed parts + 1)
  and one above it;
- a ``cake`` allocation over the three layers of the committed SmolLM2 trace (deepest
  first, so that the least preferred layer is last) at ``B = window + 1``: one selectable
  slot per layer to share, the authors' shares ``2, 1, 0``, the last floored at 1; run by
  the engine, each capped head's kept set against the reference at its cap.

An out-of-bounds access raises IndexError (exit status 1), a mismatch AssertionError.
Prints the number of checks.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from policy_checks import (TRACE, check, field_source, heads, min_budget, policy_cases,
                           qk_field, trace_field, valid)
from reference import reference_run

from kvsim.engine import allocation
from kvsim.engine.experiments import simulate_scenario
from kvsim.policies import POLICIES
from kvsim.protocols.run import resolve_params
from kvsim.scenario.load import load_scenario

T = 12

# The policies run under the allocation, with their parameters; the reference checks those
# whose reference holds on a group of query heads and whose fixed parts do not depend on B.
ALLOCATED = {"cake": {"window": 4}, "snapkv": {"window": 4, "kernel": 3}, "window": {},
             "streaming_llm": {"sinks": 2}, "knorm": {}, "h2o": {}, "tova": {}}
CHECKED = ("cake", "snapkv", "window", "streaming_llm", "knorm")


def registry_edges() -> int:
    """Every policy and variant at its minimum budget and one above, prompts 0, mid, T."""
    count = 0
    for case in policy_cases():
        name, params = case.values
        for kind in ("gauss", "ints"):  # "ints": small integer vectors, exact ties
            rng = np.random.default_rng([len(name), len(params), len(kind)])
            field = qk_field(rng, T, 2 if heads(name) else 1, kind=kind)
            src = field_source(field)
            m = min_budget(name, params)
            for P in (0, T // 2 + 1, T):
                for B in (m, m + 1):
                    if valid(name, params, T, P):
                        check(field, src, name, params, B, P, "max", important=[0, T - 1])
                        count += 1
    return count


def allocation_edges(folder: Path) -> int:
    """A cake allocation whose truncated shares leave a layer no selectable slot."""
    Tr, P, w = 48, 40, 4
    policies = "".join(f"[policies.{n}]\n" + "".join(f"{k} = {v}\n" for k, v in p.items())
                       for n, p in ALLOCATED.items())
    (folder / "s.toml").write_text(
        f'[attention]\nsource = "trace"\npath = "{TRACE}"\nlayers = [29, 15, 0]\nT = {Tr}\n'
        f'{policies}[[experiment]]\nname = "c"\nprompt_len = {P}\nbudgets = [{w + 1}]\n'
        'allocation = "cake"\n')
    scenario = load_scenario(folder / "s.toml")
    exp = scenario.experiments[0]
    prefs = allocation.cake_preferences(
        [scenario.field(0, layer).data for layer in scenario.layers], P, exp.tau1, exp.tau2)
    shares = allocation.adjust_budgets(list(prefs / prefs.sum() * len(prefs)), len(prefs), P - w)
    assert (shares == 0).any(), f"no share of 0 to floor: {shares}"  # the case is the edge
    results = simulate_scenario(scenario, progress=False, workers=1)
    with np.load(TRACE) as data:
        in_file = data["layers"].tolist()
    kept = results.steps["c"].arrays()["kept"]
    count = 0
    for r in results.rows:
        policy = POLICIES[r["kind"]]
        fixed = policy.fixed(r["budget"], P, resolve_params(policy, ALLOCATED[r["kind"]]))
        assert r["b_h"] > fixed, r
        if r["kind"] in CHECKED:
            src = field_source(trace_field(in_file.index(r["layer"]), r["kv_head"], Tr))
            want = reference_run(src, r["kind"], r["b_h"], P, **ALLOCATED[r["kind"]]).kept
            got = kept[r["unit"]]
            assert got[got >= 0].tolist() == want.tolist(), r
            count += 1
    return count


def main() -> None:
    start = time.perf_counter()
    count = registry_edges()
    middle = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        count += allocation_edges(Path(folder))
    print(f"{count} checks (registry {middle - start:.0f} s, "
          f"allocation {time.perf_counter() - middle:.0f} s)")


if __name__ == "__main__":
    sys.exit(main())
