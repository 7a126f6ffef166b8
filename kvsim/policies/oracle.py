"""``oracle``: per step, the keys with the largest full attention (unrealisable bound)."""

from kvsim import kernels
from kvsim.policies.base import Head, Policy, Trace, new_trace


def _run(head: Head, budget: int, params: dict) -> Trace:
    trace = new_trace(head)
    trace.kept = kernels.oracle(head.attn, head.prompt_len, budget, head.important,
                                trace.mass, trace.cache_size, trace.recall)
    return trace


POLICY = Policy("oracle", "per-step top B keys of the full attention (upper bound)", {}, _run)
