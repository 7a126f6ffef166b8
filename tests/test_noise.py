"""The counter-based noise (kvsim.numerics.noise): bit for bit its plain reference
(tests/noise_reference.py), and distributed as documented in docs/noise.md."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

import noise_reference as ref
from kvsim.numerics.jit import jit
from kvsim.numerics.noise import NOISE_GAUSSIAN, NOISE_GUMBEL, add_noise, add_noise_row

KEYS = [0, 1, 0x9E3779B97F4A7C15, 2**64 - 1, 12345678901234567]
KINDS = {"gaussian": NOISE_GAUSSIAN, "gumbel": NOISE_GUMBEL}


def kernel_rows(kind: str, key: int, rows, n: int, whole_row: bool = True) -> np.ndarray:
    """Noise of entries (q, k), k < n, by the row kernel or key by key (shuffled keys)."""
    out = np.zeros((len(rows), n))
    order = np.random.default_rng(key % 97).permutation(n)
    for i, q in enumerate(rows):
        if whole_row:
            add_noise_row(KINDS[kind], np.uint64(key), 1.0, q, n, out[i])
        else:
            row = np.zeros(n)
            add_noise(KINDS[kind], np.uint64(key), 1.0, q, order, n, row)
            out[i, order] = row
    return out


@pytest.mark.quick
@pytest.mark.parametrize("kind", KINDS)
def test_noise_is_its_reference_bit_for_bit(kind):
    rows = [0, 1, 2, 77, 2**20 + 3, 2**31 - 1, 2**32 - 1]
    for key in KEYS:
        expected = ref.noise_rows(kind, key, rows, 21)  # odd: a last key without its pair
        assert np.array_equal(kernel_rows(kind, key, rows, 21), expected), (kind, key)
        assert np.array_equal(kernel_rows(kind, key, rows, 21, whole_row=False), expected)
    # far keys of a long row
    far = [2**20, 2**20 + 1, 2**31 - 2, 2**31 - 1]
    out = np.zeros(4)
    add_noise(KINDS[kind], np.uint64(7), 1.0, 5, np.array(far), 4, out)
    draw = ref.gaussian if kind == "gaussian" else ref.gumbel
    assert np.array_equal(out, [draw(7, 5, k) for k in far])


@pytest.mark.quick
def test_scale_multiplies_the_draw():
    a, b = np.zeros(9), np.full(9, 1.0)
    add_noise_row(NOISE_GAUSSIAN, np.uint64(3), 1.0, 4, 9, a)
    add_noise_row(NOISE_GAUSSIAN, np.uint64(3), 0.25, 4, 9, b)
    assert np.array_equal(b, 1.0 + 0.25 * a)


@jit
def _draws(kind, key, rows, n, out):
    for q in range(rows):
        add_noise_row(kind, key, 1.0, q, n, out[q])


def _normal_checks(z: np.ndarray) -> dict:
    """The statistics the Gaussian noise is held to, with its thresholds: each is about
    five standard errors at 4 million draws."""
    n = z.size
    tail = np.mean(np.abs(z) > 3.0)
    expected_tail = 2 * stats.norm.sf(3.0)
    return {"mean": abs(z.mean()) < 5 / np.sqrt(n),
            "variance": abs(z.var() - 1.0) < 5 * np.sqrt(2 / n),
            "skewness": abs(stats.skew(z)) < 5 * np.sqrt(6 / n),
            "excess kurtosis": abs(stats.kurtosis(z)) < 5 * np.sqrt(24 / n),
            "tail beyond 3": abs(tail - expected_tail) < 5 * np.sqrt(expected_tail / n),
            "KS": stats.kstest(z, "norm").statistic < 1.63 / np.sqrt(n)}  # p ~ 0.01


def test_gaussian_noise_is_standard_normal():
    rows, n = 2048, 2048  # 4,194,304 draws, from two keys
    for key in (5, 0xDEADBEEF):
        out = np.zeros((rows, n))
        _draws(NOISE_GAUSSIAN, np.uint64(key), rows, n, out)
        z = out.ravel()
        failed = [name for name, ok in _normal_checks(z).items() if not ok]
        assert not failed, (key, failed)
        assert np.abs(z).max() < 6.8  # the largest radius 32-bit uniforms give: sqrt(66 ln 2)
        # the cosine and sine draws of a pair are uncorrelated, as are neighbouring rows
        assert abs(np.corrcoef(out[:, 0::2].ravel(), out[:, 1::2].ravel())[0, 1]) < 5 / np.sqrt(z.size / 2)
        assert abs(np.corrcoef(out[:-1].ravel(), out[1:].ravel())[0, 1]) < 5 / np.sqrt(z.size)


def test_the_normal_checks_reject_near_normal_distributions():
    """The same thresholds fail distributions close to the normal (so the test can fail)."""
    rng = np.random.default_rng(0)
    n = 2048 * 2048
    near = {"sum of 12 uniforms": rng.random((12, n), dtype=np.float32).sum(0) - 6.0,
            "Student t, 30 dof": rng.standard_t(30, n) / np.sqrt(30 / 28),
            "logistic": rng.logistic(0.0, np.sqrt(3) / np.pi, n),
            "normal, sd 1.005": rng.normal(0.0, 1.005, n)}
    for name, z in near.items():
        assert not all(_normal_checks(z).values()), name
    assert all(_normal_checks(rng.normal(size=n)).values())
