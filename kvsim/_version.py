"""kvsim's version, in a module of its own so that any module can import it at load time
(``kvsim/__init__`` imports most of the package before it could define it)."""

__version__ = "0.1.0"
