"""KIVI storage in the closed loop: the model attends over the same quantised keys and
values as the simulator's rule (tests/reference.py), and the stores stay exact."""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsim.numerics.quantize import Quantize  # noqa: E402
from kvsim.tools.study.model import Decoder, FullCache, kivi_store, stores  # noqa: E402
from tiny_models import P, T, tiny_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    """The tiny random Llama, its eager logits and its full run."""
    return tiny_llama()


@pytest.mark.parametrize("case", range(6))
def test_kivi_store_is_the_reference_rule(case):
    rng = np.random.default_rng(case)
    width, n, d = 24, int(rng.integers(1, 24)), 8
    quant = Quantize(bits=int(rng.integers(1, 5)), group=4, residual=4 * int(rng.integers(1, 3)))
    keys = torch.from_numpy(rng.standard_normal((width, d)).astype(np.float32))
    values = torch.from_numpy(rng.standard_normal((width, d)).astype(np.float32))
    slots = rng.permutation(100)[:n]  # cached positions in slot order
    want_k, want_v = ref.kivi_cache(keys[:n].numpy()[np.argsort(slots)],
                                    values[:n].numpy()[np.argsort(slots)], quant.bits,
                                    quant.group, quant.residual)
    before = keys.clone()
    kivi_store(keys, values, slots, quant)
    order = np.argsort(slots)
    assert np.array_equal(keys[:n].numpy()[order], want_k.astype(np.float32))
    assert np.array_equal(values[:n].numpy()[order], want_v.astype(np.float32))
    assert torch.equal(keys[n:], before[n:])  # slots beyond the cache untouched


def test_the_decoder_attends_over_quantised_caches_and_keeps_the_stores_exact(tiny):
    net, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    keys, values = stores(full, 3, P)
    caches = [[[FullCache(P) for _ in range(H_kv)] for _ in range(L)] for _ in range(3)]
    storage = [None, Quantize(2, 4, 64), Quantize(2, 4, 4)]  # residual 64 > T: all exact
    decoder = Decoder(net, full, P, caches, keys, values, T, storage=storage)
    differ = False
    for t in range(P, T):
        logits = decoder.step()
        assert np.array_equal(logits[1], logits[0]), t
        differ |= not np.allclose(logits[2], logits[0], atol=1e-4)
    assert differ  # 2-bit storage changes the model's outputs
    for c in range(3):  # quantising never writes to the stores: the prompt stays exact
        assert np.array_equal(keys[:, c, :, :P], full.keys[:, :, :P])
        assert np.array_equal(values[:, c, :, :P], full.values[:, :, :P])
    assert np.array_equal(keys[:, 1], keys[:, 0]) and np.array_equal(values[:, 1], values[:, 0])
