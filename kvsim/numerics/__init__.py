"""Layer 1, numerics: Numba kernels over arrays and scalars only.

``jit`` (compile options and the on-disk cache key), ``elementary`` (exp, log, cos),
``lanes`` (deterministic lane-wise reductions), ``noise`` (counter-based draws),
``field`` (logits and probabilities of a field), ``fullpass`` (the exact full-attention
pass), ``decode`` (the generic decode loop that drives a policy's steps) and ``kernels``
(the shared step helpers: ranking, ring, combining heads; the oracle's own loop).
"""
