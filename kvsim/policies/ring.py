"""The ring: a fixed set of slots refilled oldest first, with no score (no ``observe``).

Step code shared by ``window`` (a ring over every slot), ``streaming_llm`` (sinks, then
a ring) and ``snapkv`` (a pinned selection, then a ring), so they share one compiled loop.
"""

from typing import NamedTuple

from kvsim.numerics.decode import decode_kernel, observe_nothing
from kvsim.numerics.jit import jit_inline
from kvsim.numerics.kernels import ring_slot


class Ring(NamedTuple):
    """Slots ``base .. base + width - 1`` form the ring; slot ``base`` took ``start``."""

    base: int
    start: int
    width: int


@jit_inline
def admit(state, cache, n, t):
    """Append while there is room, then replace the ring's oldest key."""
    return n if n < cache.shape[0] else ring_slot(state.base, state.start, state.width, t)


decode = decode_kernel("decode", admit, observe_nothing)
