"""Whole-model traces on demand: a trace named by model, text and token count.

On first use the trace is captured (every layer, float32 vectors, with
:mod:`kvsim.tools.capture`) into the user's cache folder, ``$XDG_CACHE_HOME/kvsim/traces``
(default ``~/.cache``), under a hash of the model, the text's content, the token count and
the capture version; later uses read the cached file. Capturing needs the ``capture`` extra
(torch, transformers); replaying a cached trace does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np

from kvsim.errors import KvsimError

def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/kvsim/traces``, or ``~/.cache/kvsim/traces``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvsim" / "traces"


def _model_files(model: str, gguf_file: str, base: Path) -> tuple[str, str | None, str]:
    """(model folder, GGUF file or None, the model's identity in the cache key)."""
    from kvsim.tools import models  # an upward import, as for the capture below

    if models.preset(model) is not None:
        try:
            folder, gguf = models.resolve(model)
        except KvsimError as exc:
            raise KvsimError(str(exc), "model") from None
        return str(folder), gguf, f"{model}/{gguf}"
    folder = (base / model).resolve()
    if not folder.is_dir():
        raise KvsimError(f"expected one of {', '.join(models.PRESETS)} or a model folder, "
                         f"got {model!r}", "model")
    return str(folder), gguf_file or None, f"{folder}/{gguf_file}"


def cache_key(model_id: str, text: bytes, tokens: int, capture_version: int) -> str:
    """Hash of what determines a capture: model, text content, tokens, capture version."""
    parts = {"model": model_id, "text_sha256": hashlib.sha256(text).hexdigest(),
             "tokens": tokens, "capture_version": capture_version}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def resolve(params: dict, base: Path) -> Path:
    """The cached trace of ``params`` (``model``, ``text``, ``tokens``, ``gguf_file``),
    captured first if it is not there yet."""
    text = (base / params["text"]).resolve()
    try:
        raw = text.read_bytes()
    except OSError as exc:
        raise KvsimError(f"expected a readable text file ({exc})", "text") from None
    folder, gguf, model_id = _model_files(params["model"], params["gguf_file"] or "", base)
    # An upward import, on purpose: the capture code and its version live with `kvsim
    # capture`; it imports torch only when it runs, on a cache miss.
    from kvsim.tools import capture

    key = cache_key(model_id, raw, params["tokens"], capture.CAPTURE_VERSION)
    path = cache_folder() / f"{key}.npz"
    if path.is_file():
        return path
    print(f"kvsim: capturing every layer of {params['model']} on {text.name} "
          f"({params['tokens']} tokens) into {path} (once)", file=sys.stderr)
    try:
        # float32: in some layers of a whole model, float16 vectors miss the capture's check
        # (SmolLM2-135M: 3.1e-3 > 2e-3); a cache need not be small.
        return capture.capture(folder, text, params["tokens"], path, None, gguf, np.float32)
    except KvsimError as exc:  # the command line's option names -> the scenario's keys
        option, sep, message = str(exc).partition(": ")
        if sep and option.startswith("--"):
            raise KvsimError(message, option[2:].replace("-", "_")) from None
        raise
