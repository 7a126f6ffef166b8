"""The way into a Hugging Face model: the models and families kvsim knows (``catalog``),
the one attention hook (``adapter``), the capture of a trace (``capture``), the checks
before a model loads (``preflight``), the GGUF tokenizer and RoPE (``rope``)."""
