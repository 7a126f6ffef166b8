"""Layer 1, numerics: Numba kernels over arrays and scalars only.

``jit`` (compile options and the on-disk cache key), ``elementary`` (exp, log, cos),
``lanes`` (deterministic lane-wise reductions), ``noise`` (counter-based draws),
``field`` (logits and probabilities of a field), ``fullpass`` (the exact full-attention
pass) and ``kernels`` (ranking and the decode loop).
"""
