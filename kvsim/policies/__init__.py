"""Registry of eviction policies: the scenario name -> its implementation.

A new policy is one module and its name in :data:`MODULES`; tests iterate over this
registry. A score-only rule is one function handed to
:func:`kvsim.policies.scored.score_policy` (see ``knorm``). Otherwise the module defines
(see ``window``, ``tova``, ``h2o``):

- ``State``: a ``typing.NamedTuple`` of arrays and scalars (mutable counters as
  1-element arrays), defined at module level so that Numba types and caches it;
- ``admit(state, cache, n, t) -> slot`` and ``observe(state, cache, n, obs, mass, outputs)``,
  both ``@jit_inline`` (the protocol is in :mod:`kvsim.numerics.decode`), composed from
  the shared helpers of :mod:`kvsim.numerics.kernels` (``top_ranked``,
  ``lowest_ranked_slot`` with the total order, ``ring_slot``, ``combine_observed``,
  ``combine_rows``);
- ``decode``: ``@jit def decode(ctx, out, cache, n, state): return decode_loop(ctx, out,
  cache, n, state, admit, observe)``, naming the steps as globals (a kernel taking them
  as arguments would recompile in every process);
- ``start(prompt, budget, params, T) -> (kept, state)``: the prefill selection from the
  prompt rows of a :class:`Group` (``prompt_scores()``, ``row_scores(lo, hi)``, ``keys``,
  ``values``; ``gqa``, ``seed``) and the decode state sized for positions ``< T``;
- ``rank(state, cache, n, t, seed) -> (scores, protected)`` (optional): the current scores
  of the cached keys before token ``t`` joins, for the protocols of
  :mod:`kvsim.protocols.batched` (pages and thresholds need it);
- ``POLICY = Policy(name, summary, params, Steps(start, admit, observe, decode), ...)``
  with ``min_budget``, ``check``, ``needs`` (``{"keys", "values", "queries"}`` beyond
  attention: checked against the source, a one-line error naming both) and
  ``closed_loop`` (why it cannot run one step at a time, if so).

The simulator runs ``decode`` over a field; :class:`kvsim.policies.stepping.Stepper`
runs the same ``start``/``admit``/``observe`` one step at a time on rows from elsewhere.
"""

import importlib

# Bound before any policy module loads, so that one may import them from here.
from kvsim.policies.base import Group, Param, Policy, Steps, Trace

POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    """Add ``policy`` to the registry under its name (a policy of that name is replaced)."""
    POLICIES[policy.name] = policy
    return policy


MODULES = ("full", "window", "streaming_llm", "h2o", "snapkv", "tova", "random_eviction",
           "oracle", "knorm", "keydiff", "scissorhands", "caote", "quest",
           "rkv", "dropkv", "chunkkv", "expected_attention", "cake")
"""The registered policy modules, in registry order: each defines ``POLICY``, or
``POLICIES`` (a tuple) when it holds several."""

for _name in MODULES:
    _module = importlib.import_module(f"{__name__}.{_name}")
    for _policy in getattr(_module, "POLICIES", None) or (_module.POLICY,):
        register(_policy)

__all__ = ["MODULES", "POLICIES", "Group", "Param", "Policy", "Steps", "Trace", "register"]
