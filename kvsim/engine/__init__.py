"""Layer 4, engine: expand a scenario's experiments into units, run them on threads,
collect tidy results (``experiments``), and keep finished units for ``--resume``
(``resume``)."""
