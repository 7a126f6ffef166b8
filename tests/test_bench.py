"""The benchmark's NumPy baselines implement the same simulation as kvsim."""

import numpy as np
import pytest

import kvsim
from kvsim.bench import bench_field, dense_matrix, exp_rate
from kvsim.bench.numpy_baseline import BASELINES


@pytest.mark.parametrize("policy", sorted(BASELINES))
@pytest.mark.parametrize("T, P, B", [(96, 48, 40), (96, 16, 40), (64, 64, 40), (80, 0, 36)])
def test_numpy_baselines_agree_with_kvsim(policy, T, P, B):
    A = dense_matrix(T)
    ours = kvsim.simulate(A, policy, B, P)
    mass, kept = BASELINES[policy](A, P, B)
    assert np.allclose(ours.mass, mass, rtol=0, atol=1e-9)
    assert np.array_equal(np.sort(kept), ours.kept)


def test_dense_matrix_is_the_bench_field():
    A = dense_matrix(48)
    assert np.allclose(A.sum(axis=1), 1.0) and not np.triu(A, 1).any()
    assert bench_field(48, noise=False).key_bias[0, :4].min() == 6.0


def test_exp_rate_is_measured():
    assert exp_rate() > 1e6
