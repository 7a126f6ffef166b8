"""The ranking and reduction helpers of the kernels against plain Python on the same rule.

Rank: higher score first, equal scores by lower position. Selection must be exact on
ties and sorted runs; lane reductions must equal their defined order.
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsim.numerics.kernels import _kth_largest, lowest_ranked_slot, _top_ranked_above, _top_ranked_linear, top_ranked
from kvsim.numerics.lanes import lane_max, lane_sum, masked_min

pytestmark = pytest.mark.quick
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Few distinct values, so that ties are common; sometimes sorted or constant.
scores = st.lists(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 3.0]), min_size=1, max_size=40) \
    | st.lists(st.floats(0.0, 1.0), min_size=1, max_size=40)


def top_k_reference(x, k):
    return sorted(sorted(range(len(x)), key=lambda j: (-x[j], j))[:k])


@SETTINGS
@given(values=scores, data=st.data())
def test_top_ranked_is_the_rank_rule(values, data):
    x = np.array(values)
    n = len(values)
    k = data.draw(st.integers(1, n))
    assert _kth_largest(x, n, k) == sorted(values, reverse=True)[k - 1]
    out = np.empty(n, np.int64)
    filled = _top_ranked_linear(x, n, k, out)
    assert list(out[:filled]) == top_k_reference(values, k)
    lo = data.draw(st.integers(0, n - 1))
    assert list(top_ranked(x, lo, n, k)) == [lo + j for j in top_k_reference(values[lo:], k)]
    # any starting threshold gives the same exact selection
    guess = data.draw(st.sampled_from([0.0, 0.3, 0.9, 5.0, -np.inf]))
    pos, val = np.empty(n, np.int64), np.empty(n)
    filled, kth = _top_ranked_above(x, n, k, guess, out, pos, val)
    assert list(out[:filled]) == top_k_reference(values, k)
    if k < n:
        assert kth == sorted(values, reverse=True)[k - 1]


@SETTINGS
@given(values=scores, data=st.data())
def test_lowest_ranked_slot_is_the_rank_rule(values, data):
    n = len(values)
    T = 2 * n + 3
    cache = np.array(data.draw(st.permutations(range(T)))[:n], np.int64)
    value = np.array(values)
    limit = data.draw(st.integers(0, T))
    slot_of = np.full(T, -1, np.int64)
    slot_of[cache] = np.arange(n)
    eligible = [j for j in range(n) if cache[j] < limit]
    expected = max(eligible, key=lambda j: (-value[j], cache[j])) if eligible else -1
    assert lowest_ranked_slot(cache, n, value, limit, slot_of) == expected


@SETTINGS
@given(values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), data=st.data())
def test_lane_reductions(values, data):
    x = np.array(values)
    n = len(values)
    assert lane_max(x, n) == max(values)
    lanes = [0.0] * 8
    whole = n - n % 8
    for k in range(whole):
        lanes[k % 8] += values[k]
    for k in range(whole, n):
        lanes[0] += values[k]
    pairs = [lanes[0] + lanes[1], lanes[2] + lanes[3], lanes[4] + lanes[5], lanes[6] + lanes[7]]
    expected = (pairs[0] + pairs[1]) + (pairs[2] + pairs[3])
    assert lane_sum(x, n) == expected  # the documented order, bit for bit
    key = np.array(data.draw(st.lists(st.integers(0, 9), min_size=n, max_size=n)), np.int64)
    limit = data.draw(st.integers(0, 10))
    below = [v for v, kk in zip(values, key) if kk < limit]
    assert masked_min(x, key, n, limit) == (min(below) if below else np.inf)
