"""Checks of a model run's inputs that need no model: run before torch is imported.

Each check adds one line per problem to a scenario :class:`~kvsim.scenario.reader.Checker`
(``chk.add(key, message)``); closed-loop and task files share them.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kvsim.paths import read_text

WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")
INSTALL = ("without a GPU, pip install torch --index-url https://download.pytorch.org/whl/cpu "
           'first; then pip install -e ".[capture]"')
"""How to install the capture extra (a CPU-only torch first: the default wheel is CUDA's)."""
NEEDS = f"Needs the capture extra: {INSTALL}."
"""The line of a command's ``--help`` that needs the capture extra."""


def missing_extra(gguf: bool) -> list[str]:
    """The modules of the capture extra (torch, transformers, threadpoolctl and, for GGUF
    weights, gguf) that are not installed, looked up without importing them."""
    return [m for m in ("torch", "transformers", "threadpoolctl", *(("gguf",) if gguf else ()))
            if importlib.util.find_spec(m) is None]


def check_extra(chk, key: str, gguf: bool) -> None:
    """The capture extra is installed (:func:`missing_extra`)."""
    missing = missing_extra(gguf)
    if missing:
        chk.add(key, f'expected the capture extra ({INSTALL}); missing: {", ".join(missing)}')


def check_model_folder(chk, key: str, model: Path, gguf: str | None) -> None:
    """A Hugging Face folder holds ``config.json`` and weights (GGUF weights are checked by
    the caller as ``gguf_file``)."""
    if gguf or not model.is_dir():
        return
    if not (model / "config.json").is_file():
        chk.add(key, f"expected a model folder with config.json, got {str(model)!r}")
    elif not any(any(model.glob(p)) for p in WEIGHTS):
        chk.add(key, f"expected a model folder with weights ({', '.join(WEIGHTS)}), "
                     f"got {str(model)!r}")


def check_text(chk, key: str, path: Path, tokens_key: str, tokens: int) -> None:
    """The text is readable (:func:`kvsim.paths.read_text`) and could hold ``tokens`` tokens: a
    token covers at least one byte of the text."""
    try:
        size = len(read_text(path).encode("utf-8"))
    except ValueError as exc:
        chk.add(key, f"expected a readable UTF-8 text file, got {str(path)!r} ({exc})")
        return
    if size < tokens:
        chk.add(tokens_key, f"expected at most the text's tokens, got {tokens} for a text "
                            f"of {size} bytes (a token covers at least one byte)")
