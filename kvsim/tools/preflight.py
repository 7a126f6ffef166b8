"""Checks of a model run's inputs that need no model: run before torch is imported.

Each check adds one line per problem to a scenario :class:`~kvsim.scenario.load._Checker`
(``chk.add(key, message)``); closed-loop and task files share them.
"""

from __future__ import annotations

import importlib.util
import os
import stat
from pathlib import Path

MAX_TEXT_BYTES = 64 * 2**20  # a text file larger than this is refused, never read
WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.gguf")


def check_extra(chk, key: str, gguf: bool) -> None:
    """The capture extra (torch, transformers and, for GGUF weights, gguf) is installed,
    looked up without importing it."""
    missing = [m for m in ("torch", "transformers", *(("gguf",) if gguf else ()))
               if importlib.util.find_spec(m) is None]
    if missing:
        chk.add(key, f'expected the capture extra (pip install -e ".[capture]"); missing: '
                     f'{", ".join(missing)}')


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


def read_text(path: Path) -> str:
    """A regular UTF-8 text file of at most ``MAX_TEXT_BYTES``; anything else (a folder,
    a FIFO, a device, a symlink loop, bytes that are not UTF-8) raises ``ValueError``
    with the reason, without blocking or reading more than the limit."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError("not a regular file")
    if info.st_size > MAX_TEXT_BYTES:
        raise ValueError(f"{info.st_size} bytes, more than {MAX_TEXT_BYTES}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as exc:
        raise ValueError(exc.strerror or str(exc)) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 (byte {exc.start})") from None


def check_text(chk, key: str, path: Path, tokens_key: str, tokens: int) -> None:
    """The text is readable (see :func:`read_text`) and could hold ``tokens`` tokens: a
    token covers at least one byte of the text."""
    try:
        size = len(read_text(path).encode("utf-8"))
    except ValueError as exc:
        chk.add(key, f"expected a readable UTF-8 text file, got {str(path)!r} ({exc})")
        return
    if size < tokens:
        chk.add(tokens_key, f"expected at most the text's tokens, got {tokens} for a text "
                            f"of {size} bytes (a token covers at least one byte)")
