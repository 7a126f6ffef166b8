"""``oracle``: per step, the keys with the largest full attention (unrealisable bound)."""

from kvsim import kernels
from kvsim.policies.base import Group, Policy, Trace, new_trace


def _run(group: Group, budget: int, params: dict) -> Trace:
    trace = new_trace(group)
    trace.kept = kernels.oracle(group.field, group.row_max, group.row_sum, group.heads,
                                group.prompt_len, budget, group.gqa, group.important,
                                group.full_output, trace.mass, trace.cache_size, trace.recall,
                                trace.error)
    return trace


POLICY = Policy("oracle", "per-step top B keys of the full attention (upper bound)", {}, _run)
