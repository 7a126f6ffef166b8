"""Tools beside the pipeline: ``bench`` (``python -m kvsim bench``) and ``capture``
(record a real model's attention as a trace)."""
