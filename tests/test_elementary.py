"""kvsim's own exp and log (kvsim.numerics.elementary) against NumPy's, in units of last place."""

import numpy as np
import pytest

from kvsim.numerics.elementary import exp_nonpositive, log_positive

pytestmark = pytest.mark.quick


def _ulps(ours, ref):
    return np.abs(ours - ref) / np.spacing(np.abs(ref))


def test_exp_nonpositive_within_two_ulp():
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.random(20_000) * 708.0, -rng.random(20_000), [0.0, -0.5 * np.log(2.0),
                        -np.log(2.0), -708.0]])
    ours = np.array([exp_nonpositive(v) for v in x])
    assert _ulps(ours, np.exp(x)).max() <= 2.0
    assert exp_nonpositive(0.0) == 1.0
    assert exp_nonpositive(-709.0) == 0.0 and exp_nonpositive(-np.inf) == 0.0


def test_log_positive_within_two_ulp():
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.random(20_000), rng.random(2_000) * 1e-300, rng.random(2_000) * 1e6,
                        [2.0 ** -53, 0.5, np.sqrt(2.0), np.nextafter(np.sqrt(2.0), 2.0), 2.0, 3.0]])
    ours = np.array([log_positive(v) for v in x])
    assert _ulps(ours, np.log(x)).max() <= 2.0
    assert log_positive(1.0) == 0.0
