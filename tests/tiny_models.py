"""Tiny random models (no download) shared by the closed-loop tests, and a policy wrapper
that checks the loop at every step. Import after ``pytest.importorskip("transformers")``."""

from __future__ import annotations

import numpy as np
import torch
import transformers

from kvsim.models.adapter import attach
from kvsim.tools.study.model import prefill

T, P = 40, 16
"""The tiny Llama's sequence and prompt lengths."""

WINDOW = 6
"""The tiny Gemma's sliding window."""

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def tiny_llama_net(vocab_size: int = 50, positions: int = 64):
    """A tiny random Llama (2 layers, 4 query heads over 2 KV heads, seed 0), eager."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=vocab_size, max_position_embeddings=positions,
        initializer_range=0.3)
    net = transformers.LlamaForCausalLM(config).eval()
    net.set_attn_implementation("eager")
    return net


def tiny_llama():
    """:func:`tiny_llama_net`, its eager logits over ``T`` random tokens and its full run
    through kvsim's attention function."""
    net = tiny_llama_net()
    ids = np.random.default_rng(0).integers(0, 50, T)
    with torch.no_grad():
        eager = net(torch.as_tensor(ids[None])).logits[0].numpy()
    attach(net)
    return net, eager, prefill(net, ids, rope=True)


def tiny_gemma(window: int = WINDOW):
    """A tiny random Gemma-3: 4 layers (sliding, global, sliding, global), 2 query heads
    over one KV head, a scaling (query_pre_attn_scalar 8) that is not head_dim ** -0.5."""
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, vocab_size=50, max_position_embeddings=64,
        sliding_window=window, layer_types=TYPES, query_pre_attn_scalar=8,
        initializer_range=0.3)
    return transformers.Gemma3ForCausalLM(config).eval()


class Watched:
    """A policy that checks, at every step, its budget and what the model lets it observe,
    and that no token of ``question`` evicts (they join without eviction)."""

    def __init__(self, inner, budget: int, layer: int, log: list, question: range = range(0)):
        self.inner, self.budget, self.layer, self.log = inner, budget, layer, log
        self.question = question

    @property
    def cache(self):
        return self.inner.cache

    def admit(self, t):
        evicted = self.inner.admit(t)
        assert len(self.inner.cache) <= self.budget and t in self.inner.cache
        if t in self.question:
            assert evicted == -1, t
        return evicted

    def observe(self, attention, output=None):
        assert attention.shape[1] == len(self.inner.cache) <= self.budget
        assert np.allclose(attention.sum(axis=1), 1.0, atol=1e-5)
        self.log.append((self.layer, len(self.inner.cache)))
        self.inner.observe(attention, output)


def smollm2_closed_loop(tmp_path, real_model_loader, policies: str):
    """``(report folder, results.csv rows)`` of a 48-token closed loop on SmolLM2 (prompt 32,
    budgets 8 and 16) with the ``[policies.*]`` tables ``policies``."""
    import csv

    from kvsim.tools.closed_loop import command

    real_model_loader(command, "smollm2-135m")
    (tmp_path / "c.toml").write_text(
        'name = "smol"\n[closed_loop]\ntext = "gpl-3"\ntokens = 48\nprompt_len = 32\n'
        'budgets = [8, 16]\n' + policies)
    out = command.closed_loop_report(tmp_path / "c.toml", tmp_path / "r", progress=False)
    with open(out / "results.csv") as f:
        return out, list(csv.DictReader(f))
