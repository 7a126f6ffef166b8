"""RoPE in float64: the rotation the attention components apply and the capture checks."""

from __future__ import annotations

import numpy as np


def rope_frequencies(theta: float, d: int) -> np.ndarray:
    """(d/2,) RoPE inverse frequencies ``theta ** (-2 i / d)`` (as Llama's rotary embedding)."""
    return 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)


def rotate(x: np.ndarray, freq: np.ndarray, scale: float = 1.0) -> np.ndarray:
    """RoPE of the rows of ``x`` (..., T, d) at positions ``0 .. T-1`` in float64, cos and
    sin times ``scale``: dimension ``i < n`` pairs with ``i + n`` (rotate-half layout,
    ``n = len(freq)``); dimensions from ``2 n`` on pass unchanged."""
    x = x.astype(np.float64)
    n = freq.shape[0]
    angles = np.arange(x.shape[-2], dtype=np.float64)[:, None] * freq[None, :]
    c, s = scale * np.cos(angles), scale * np.sin(angles)
    out = x.copy()
    out[..., :n] = x[..., :n] * c - x[..., n:2 * n] * s
    out[..., n:2 * n] = x[..., n:2 * n] * c + x[..., :n] * s
    return out
