"""A stand-in for :func:`kvsim.tools.capture.capture` (no model): shared by the tests of
on-demand traces."""

from __future__ import annotations

import numpy as np


def fake_capture(calls: list):
    """A capture that records its calls in ``calls`` and writes random vectors."""
    def capture(model, text, tokens, out, layers=None, gguf_file=None, dtype=np.float16):
        calls.append((model, tokens, dtype))
        rng = np.random.default_rng(tokens)
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, queries=rng.standard_normal((2, 4, tokens, 8)).astype(np.float16),
                 keys=rng.standard_normal((2, 2, tokens, 8)).astype(np.float16),
                 layers=np.array([0, 1]))
        return out
    return capture
