"""The tokenizer of a GGUF file as transformers >= 5.3 builds it, on older transformers too.

transformers before 5.3 (kvpress 0.5.5 pins ``transformers<5.3``) builds two of kvsim's named
models' tokenizers differently from the transformers releases after it:

- Gemma-3: a Unigram model over the file's scores (which are not Gemma's merge order) and
  no BOS, so ``"pass key"`` becomes ``"▁p" "ass" "▁k" "ey"`` and every prompt loses ``<bos>``;
- SmolLM2 (a ``gpt2`` vocabulary in a ``llama`` file): a CodeLlama tokenizer that adds
  ``<|im_start|>`` as BOS and takes it for the EOS too.

:func:`repaired` rebuilds such a tokenizer the way transformers' ``gguf_tokenizer_mapping``
(5.3 and later) does, so that kvsim's prompts and answers are the same ids and text on both:
Gemma's merges recovered from the vocabulary in file order (its double spaces respelled
``▁▁``), a byte-level BPE from the file's merges for ``gpt2``, the control tokens as special
tokens, the user-defined ones as added tokens, BOS/EOS/UNK/PAD named by the file's ids, and
BOS added where the file says so (by default for a sentencepiece ``llama`` vocabulary).
On a transformers that has that module, the tokenizer is returned as it is.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

_SPECIAL = {"bos_token": "bos_token_id", "eos_token": "eos_token_id",
            "unk_token": "unk_token_id", "pad_token": "pad_token_id"}


def current() -> bool:
    """Whether this transformers builds GGUF tokenizers the way kvsim expects (>= 5.3)."""
    return importlib.util.find_spec("transformers.integrations.gguf") is not None and \
        importlib.util.find_spec("transformers.integrations.gguf.gguf_tokenizer_mapping") \
        is not None


def load(model: str | Path, gguf_file: str):
    """The tokenizer of ``gguf_file`` in the local folder or cached hub id ``model`` (never
    downloading), as transformers >= 5.3 builds it (:func:`repaired`)."""
    from transformers import AutoTokenizer
    from transformers.utils import cached_file

    raw = AutoTokenizer.from_pretrained(str(model), gguf_file=gguf_file, local_files_only=True)
    return repaired(raw, cached_file(str(model), gguf_file, local_files_only=True))


def repaired(tokenizer, gguf_path: str | Path):
    """``tokenizer`` (loaded by transformers from ``gguf_path``), or on transformers < 5.3
    the tokenizer that transformers >= 5.3 builds from the same file."""
    if current():
        return tokenizer
    return rebuilt(gguf_path, tokenizer.name_or_path) or tokenizer


def rebuilt(gguf_path: str | Path, name_or_path: str = ""):
    """The tokenizer transformers >= 5.3 builds from ``gguf_path``, built with the classes
    of the installed transformers; None for a vocabulary other than Gemma's sentencepiece
    or a byte-level BPE (``gpt2``)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    parsed = load_gguf_checkpoint(str(gguf_path))
    table, config = parsed["tokenizer"], parsed["tokenizer_config"]
    kind, architecture = table.get("tokenizer_type"), parsed["config"]["model_type"]
    if kind == "gpt2":
        backend = _byte_level(table)
    elif kind == "llama" and architecture.startswith("gemma"):
        backend = _gemma(table)
    else:  # a vocabulary kvsim's named models do not use: transformers' own
        return None
    _add_special_tokens(backend, table)
    from transformers import PreTrainedTokenizerFast

    names = {name: table["tokens"][table[key]] for name, key in _SPECIAL.items()
             if table.get(key) is not None}
    add_bos = config.get("add_bos_token", kind == "llama")
    out = PreTrainedTokenizerFast(tokenizer_object=backend.backend_tokenizer, **names,
                                  add_bos_token=add_bos,
                                  add_eos_token=config.get("add_eos_token", False))
    if config.get("chat_template"):
        out.chat_template = config["chat_template"]
    out.name_or_path = name_or_path
    return out


def _gemma(table: dict):
    """Sentencepiece with Gemma's two fixes: tokens of spaces respelled ``▁``, and merges
    rebuilt from the vocabulary ranked by the tokens' order in the file."""
    from transformers import GemmaTokenizer
    from transformers.tokenization_utils_base import generate_merges

    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in table["tokens"]]
    vocab = {token: index for index, token in enumerate(tokens)}
    ranks = {token: -index for index, token in enumerate(tokens)}
    return GemmaTokenizer(vocab=vocab, merges=generate_merges(vocab, ranks))


def _byte_level(table: dict):
    """Byte-level BPE from the file's vocabulary and merges."""
    from transformers import GPT2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {token if set(token) <= alphabet
             else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(table["tokens"])}
    return GPT2Tokenizer(vocab=vocab,
                         merges=[tuple(m.split(" ")) for m in table.get("merges", ())])


def _add_special_tokens(tokenizer, table: dict) -> None:
    """The file's control tokens (type 3) as special tokens, its user-defined ones (type 4)
    as plain added tokens; in a byte-level vocabulary, a control token spelled outside the
    byte alphabet is a mislabel and is skipped."""
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = set(bytes_to_unicode().values()) if table.get("tokenizer_type") == "gpt2" else None
    types = table.get("token_type") or ()
    control = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(table["tokens"], types)
               if kind == 3 and (spelled is None or set(t) <= spelled)]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control},
                                     replace_extra_special_tokens=False)
    vocab = tokenizer.get_vocab()
    user = [AddedToken(t, normalized=False, special=False)
            for t, kind in zip(table["tokens"], types) if kind == 4 and t in vocab]
    if user:
        tokenizer.add_tokens(user)
