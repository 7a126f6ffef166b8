"""Registry of eviction policies: the scenario name -> its implementation.

A new policy is one module of this package that defines ``POLICY``: it is found and
registered on import (:data:`ORDER` only sets the order of listings); tests iterate over
this registry. A score-only rule is one function handed to
:func:`kvsim.policies.scored.score_policy` (see ``knorm``). Otherwise the module defines
(see ``window``, ``tova``, ``h2o``):

- ``State``: a ``typing.NamedTuple`` of arrays and scalars (mutable counters as
  1-element arrays), defined at module level so that Numba types and caches it;
- ``admit(state, cache, n, t) -> slot`` and ``observe(state, cache, n, obs, mass, outputs)``,
  both ``@jit_inline`` (the protocol is in :mod:`kvsim.numerics.decode`), composed from
  the shared helpers of :mod:`kvsim.numerics.kernels` (``top_ranked``,
  ``lowest_ranked_slot`` with the total order, ``ring_slot``, ``combine_observed``,
  ``combine_rows``);
- ``decode = decode_kernel("decode", admit, observe)``: the policy's own copy of the
  decode loop of :mod:`kvsim.numerics.decode`, with its steps as globals;
- ``start(prompt, budget, params, T) -> (kept, state)``: the prefill selection from the
  prompt rows of a :class:`Group` (``prompt_scores()``, ``row_scores(lo, hi)``, ``keys``,
  ``values``; ``gqa``, ``seed``) and the decode state sized for positions ``< T``;
- ``rank(state, cache, n, t, seed) -> (scores, protected)`` (optional): the current scores
  of the cached keys before token ``t`` joins, for the protocols of
  :mod:`kvsim.protocols.dispatch` (pages and thresholds need it);
- ``POLICY = Policy(name, summary, params, Steps(start, admit, observe, decode), ...)``
  with ``min_budget``, ``check``, ``needs`` (``{"keys", "values", "queries"}`` beyond
XX

The simulator runs ``decode`` over a field; :class:`kvsim.protocols.stepping.Stepper`
runs the same ``start``/``admit``/``observe`` one step at a time on rows from elsewhere.
"""

import importlib
import pkgutil

# Bound before any policy module loads, so that one may import them from here.
from kvsim.policies.base import Group, Param, Policy, Presentation, Steps, Trace
from kvsim.policies.layout import StateLayout

POLICIES: dict[str, Policy] = {}


def register(policy: Policy) -> Policy:
    """Add ``policy`` to the registry under its name (a policy of that name is replaced)."""
    POLICIES[policy.name] = policy
    return policy


ORDER = ("full", "window", "streaming_llm", "h2o", "snapkv", "tova", "random_eviction",
         "oracle", "knorm", "keydiff", "scissorhands", "caote", "quest",
         "rkv", "dropkv", "chunkkv", "expected_attention", "cake")
"""The built-in policy modules, in registry order; other modules of the package that
define ``POLICY`` (or ``POLICIES``, a tuple, when they hold several) follow by name."""


def policy_modules() -> list[str]:
    """The names of this package's modules, those of :data:`ORDER` first, in its order."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__))
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


for _name in policy_modules():
    _module = importlib.import_module(f"{__name__}.{_name}")
    _found = getattr(_module, "POLICIES", None)
    if not isinstance(_found, tuple):  # a helper module, or one policy
        _found = (_module.POLICY,) if isinstance(getattr(_module, "POLICY", None), Policy) else ()
    for _policy in _found:
        register(_policy)

__all__ = ["ORDER", "POLICIES", "Group", "Param", "Policy", "Presentation", "StateLayout", "Steps",
           "Trace", "register"]
