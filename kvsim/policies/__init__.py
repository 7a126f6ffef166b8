"""Registry of eviction policies: the scenario name -> its implementation.

A new policy is one module defining a :class:`~kvsim.policies.base.Policy` and one
entry below.
"""

from kvsim.policies import (caote, full, h2o, keydiff, knorm, oracle, quest, random_eviction,
                            scissorhands, snapkv, streaming_llm, tova, window)
from kvsim.policies.base import Group, Param, Policy, Trace

POLICIES: dict[str, Policy] = {p.name: p for p in (
    full.POLICY,
    window.POLICY,
    streaming_llm.POLICY,
    h2o.ONLINE,
    h2o.OFFLINE,
    snapkv.POLICY,
    tova.POLICY,
    random_eviction.POLICY,
    oracle.POLICY,
    knorm.POLICY,
    keydiff.POLICY,
    scissorhands.POLICY,
    caote.POLICY,
    quest.POLICY,
)}

__all__ = ["POLICIES", "Group", "Param", "Policy", "Trace"]
