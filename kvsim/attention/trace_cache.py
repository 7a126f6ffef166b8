"""Whole-model traces on demand: a trace named by model, text and token count.

On first use the trace is captured (every layer, float32 vectors, with
:mod:`kvsim.models.capture`) into the user's cache folder, ``$XDG_CACHE_HOME/kvsim/traces``
(default ``~/.cache``), under a hash of the model, the text's content, the token count and
the capture version; later uses read the cached file. Capturing needs the ``capture`` extra
(torch, transformers); replaying a cached trace does not.

A cached file is checked before use (every member's CRC-32 and compressed stream, the
arrays' headers against the token count): a truncated, corrupt or wrong-shaped one is
captured again. Captures write a temporary file and rename it, so concurrent runs never
see a half-written trace. A cache folder that cannot be read or written is skipped: the
capture goes to a temporary folder removed at exit. Each capture says so in one line on
stderr (why, what, where); without the capture extra, a trace that must be captured is a
one-line error instead.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

from kvsim.attention import files
from kvsim.errors import KvsimError
from kvsim.paths import read_text
from kvsim.models import preflight

def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/kvsim/traces``, or ``~/.cache/kvsim/traces``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvsim" / "traces"


def _model_files(model: str, gguf_file: str, base: Path) -> tuple[str, str | None, str]:
    """(model folder, GGUF file or None, the model's identity in the cache key)."""
    from kvsim.models import catalog

    if catalog.preset(model) is not None:
        try:
            folder, gguf = catalog.resolve(model)
        except KvsimError as exc:
            raise KvsimError(str(exc), "model") from None
        return str(folder), gguf, f"{model}/{gguf}"
    folder = Path(os.path.realpath(base / model))
    if not folder.is_dir():
        raise KvsimError(f"expected one of {', '.join(catalog.PRESETS)} or a model folder, "
                         f"got {model!r}", "model")
    problem = catalog.family_problem(folder, gguf_file or None)
    if problem:  # refused when the scenario is read, before any capture
        raise KvsimError(problem, "model")
    return str(folder), gguf_file or None, f"{folder}/{gguf_file}"


_UNCACHED: dict[str, Path] = {}  # captures of this process outside an unusable cache


def damage(path: Path, tokens: int) -> str | None:
    """Why a cached trace of ``tokens`` tokens cannot be used, or None: a member failing
    its CRC-32 or its decompression (truncated or corrupt), a missing array, or shapes
    that are not those of the capture."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()  # reads every member once, checking its CRC-32
        if bad is not None:
            return f"{bad} fails its checksum"
        found = files.headers(path)
    except (*files.READ_ERRORS, KvsimError) as exc:
        return str(exc) or type(exc).__name__
    for name in ("queries", "keys"):
        if name not in found:
            return f"no {name} array"
        shape = found[name][0]
        if len(shape) != 4 or shape[2] != tokens:
            return f"{name} of shape {shape}, expected (layers, heads, {tokens}, dim)"
    if found["queries"][0][0] != found["keys"][0][0]:
        return "queries and keys of different layer counts"
    return None


def _unwritable(folder: Path) -> str | None:
    """Why ``folder`` cannot receive a trace, or None (it is created if missing)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as exc:
        return f"cannot be written ({exc.strerror or exc})"


def cache_key(model_id: str, text: bytes, tokens: int, capture_version: int) -> str:
    """Hash of what determines a capture: model, text content, tokens, capture version."""
    parts = {"model": model_id, "text_sha256": hashlib.sha256(text).hexdigest(),
             "tokens": tokens, "capture_version": capture_version}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def resolve(params: dict, base: Path) -> Path:
    """The cached trace of ``params`` (``model``, ``text``, ``tokens``, ``gguf_file``),
    captured first if it is not there yet."""
    from kvsim.texts import shipped_text

    text = shipped_text(params["text"]) or Path(os.path.realpath(base / params["text"]))
    try:
        raw = read_text(text).encode("utf-8")  # the file's bytes, known to be UTF-8
    except ValueError as exc:
        raise KvsimError(f"expected a readable UTF-8 text file ({exc})", "text") from None
    folder, gguf, model_id = _model_files(params["model"], params["gguf_file"] or "", base)
    # On demand: the capture imports torch only when it runs, on a cache miss.
    from kvsim.models import capture

    key = cache_key(model_id, raw, params["tokens"], capture.CAPTURE_VERSION)
    if key in _UNCACHED:
        return _UNCACHED[key]
    path = cache_folder() / f"{key}.npz"
    try:
        cached, unusable = path.is_file(), None
    except OSError as exc:  # a cache folder that cannot be searched: skipped, as below
        cached, unusable = False, f"cannot be read ({exc.strerror or exc})"
    notes = []
    if cached:
        problem = damage(path, params["tokens"])
        if problem is None:
            return path
        notes.append(f"the cached trace {path} is unusable ({problem})")
    what = f"every layer of {params['model']} on {text.name} ({params['tokens']} tokens)"
    missing = preflight.missing_extra(gguf is not None)
    if missing:
        raise KvsimError(f"expected the capture extra ({preflight.INSTALL}) to capture {what}"
                         f"{f', as {notes[0]}' if notes else ''}; missing: "
                         f"{', '.join(missing)}", "model")
    unusable = unusable or _unwritable(path.parent)
    if unusable:
        notes.append(f"the trace cache {path.parent} {unusable}")
        out = Path(tempfile.mkdtemp(prefix="kvsim-trace-")) / path.name
        atexit.register(shutil.rmtree, out.parent, True)
        where = f"into {out}, removed at exit"
    else:
        out, where = path, f"into {path} (once)"
    print(f"kvsim: {'; '.join([*notes, f'capturing {what} {where}'])}", file=sys.stderr)
    try:
        # float32: in some layers of a whole model, float16 vectors miss the capture's check
        # (SmolLM2-135M: 3.1e-3 > 2e-3); a cache need not be small.
        capture.capture(folder, text, params["tokens"], out, None, gguf, np.float32)
    except KvsimError as exc:  # the command line's option names -> the scenario's keys
        option, sep, message = str(exc).partition(": ")
        if sep and option.startswith("--"):
            raise KvsimError(message, option[2:].replace("-", "_")) from None
        raise
    if unusable:
        _UNCACHED[key] = out
    return out
