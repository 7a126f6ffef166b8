"""A stand-in for :func:`kvsim.models.capture.capture` (no model): shared by the tests of
on-demand traces."""

from __future__ import annotations

import numpy as np


def fake_capture(calls: list):
    """A capture that records its calls in ``calls`` and writes random vectors."""
    def capture(model, text, tokens, out, layers=None, gguf_file=None, dtype=np.float16):
        calls.append((model, tokens, dtype))
        rng = np.random.default_rng(tokens)
        out.parent.mkdir(parents=True, exist_ok=True)
        np.savez(out, queries=rng.standard_normal((2, 4, tokens, 8)).astype(np.float16),
                 keys=rng.standard_normal((2, 2, tokens, 8)).astype(np.float16),
                 layers=np.array([0, 1]))
        return out
    return capture


def use_fake_capture(monkeypatch, calls: list) -> None:
    """Captures of on-demand traces go to :func:`fake_capture`, whether or not the capture
    extra is installed."""
    from kvsim.models import capture, preflight

    monkeypatch.setattr(capture, "capture", fake_capture(calls))
    monkeypatch.setattr(preflight, "missing_extra", lambda gguf: [])


def fake_model(folder) -> None:
    """An empty model folder of a family kvsim supports (its config.json names a Llama):
    what on-demand traces and study files check before a capture or a model load."""
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')


def fake_gguf(path, architecture: str, chat_template: str | None = None) -> None:
    """A GGUF file without tensors (written by the gguf package) whose header names its
    ``architecture``, with a token list and arrays before its optional chat template."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_token_list(["<s>", "a", "bb", "ccc"])
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_uint32("test.count", 7)
    writer.add_float32("test.scale", 0.5)
    writer.add_bool("test.flag", True)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
