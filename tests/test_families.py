"""Every supported model family through the same checks, on a tiny random model of each.

The table is :data:`kvsim.models.catalog.FAMILIES` itself (Llama, Gemma-3, Qwen2, Qwen3,
Mistral, Phi-3; :func:`kvsim.models.catalog.tiny_model`), so a family joins the list only by
passing:

- the full cache through kvsim's attention function (prefill, then decoded step by step)
  gives the stock eager logits (1e-4), and each layer's window is the one
  ``config.layer_types`` declares;
- the queries before RoPE, computed from the projections, rotate into the queries the
  attention receives (closed loop), and capture works: its RoPE check and its replay check
  against the model's own eager attention weights pass;
- under compressed caches every global layer and KV head holds at most its budget at every
  step of a short closed-loop decode.

Then the adapter's refusals: an unknown layer type, a window the config does not declare;
and a family outside the list, tried with a warning.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvsim.models.rope import rotate  # noqa: E402
from kvsim.errors import KvsimError  # noqa: E402
from kvsim.policies import POLICIES  # noqa: E402
from kvsim.protocols.run import resolve_params  # noqa: E402
from kvsim.scenario.load import PolicyConfig  # noqa: E402
from kvsim.models import catalog  # noqa: E402
from kvsim.models.adapter import UnsupportedFamilyWarning, attach, windows  # noqa: E402
from kvsim.models.capture import check, record  # noqa: E402
from kvsim.tools.study.model import Decoder, FullCache, prefill, query_stores, stores  # noqa: E402
from kvsim.tools.closed_loop.run import make_steppers  # noqa: E402
from kvsim.tools.study.grid import query_runs  # noqa: E402
from tiny_models import Watched  # noqa: E402

T, P, BUDGET = 40, 16, 8
POLICY_NAMES = ("window", "h2o", "tova", "keydiff", "expected_attention")


def stock(net, ids):
    """The stock eager logits (T, V) and attention weights (L, H, T, T) of ``net``."""
    net.set_attn_implementation("eager")
    with torch.no_grad():
        out = net(torch.as_tensor(ids[None]), output_attentions=True)
    return out.logits[0].numpy(), np.stack([w[0].numpy() for w in out.attentions])


@pytest.fixture(scope="module", params=list(catalog.FAMILIES))
def tiny(request):
    """A tiny random model of one family, its stock eager logits and weights over ``T``
    random tokens, and its full run through kvsim's attention function."""
    net = catalog.tiny_model(request.param, 64)
    ids = np.random.default_rng(0).integers(0, catalog.TINY["vocab_size"], T)
    logits, weights = stock(net, ids)
    attach(net)
    return net, ids, logits, weights, prefill(net, ids, rope=True)


def test_full_cache_gives_the_stock_logits(tiny):
    net, _, eager, _, full = tiny
    assert [g.window for g in full.geometry] == windows(net.config)
    assert full.global_layers  # a policy has layers to compress
    assert np.abs(full.logits - eager).max() < 1e-4
    L, H_kv = full.keys.shape[:2]
    keys, values = stores(full, 1, P)
    caches = [[[FullCache(P) if layer in full.global_layers else None for _ in range(H_kv)]
               for layer in range(L)]]
    decoder = Decoder(net, full, P, caches, keys, values, T)
    assert max(np.abs(decoder.step() - eager[t]).max() for t in range(P, T)) < 1e-4


def test_queries_before_rope_rotate_into_the_attentions_queries(tiny):
    _, _, _, _, full = tiny
    for layer, (freq, scale) in enumerate(full.rope):
        post = full.queries[layer]
        worst = np.abs(rotate(full.pre_rope_queries[layer], freq, scale) - post).max()
        assert worst <= 1e-5 * np.abs(post).max(), layer


def test_capture_works(tiny):
    net, ids, _, weights, _ = tiny
    trace = record(net, ids)  # its RoPE check passes, or it raises
    assert check(trace, weights) < 2e-3
    assert trace["windows"].tolist() == windows(net.config)
    assert trace["pre_rope_queries"].shape == trace["queries"].shape
    assert net.config._attn_implementation == "kvsim"  # as it was before the capture


def test_budgets_hold_at_every_step(tiny):
    net, _, _, _, full = tiny
    L, H_kv = full.keys.shape[:2]
    runs = [(PolicyConfig(name, name, resolve_params(POLICIES[name], {})), BUDGET)
            for name in POLICY_NAMES]
    keys, values = stores(full, len(runs), P)
    queries = query_stores(full, query_runs(runs), P)
    log: list = []
    steppers = [[[None if s is None else Watched(s, BUDGET, layer, log) for s in per_kv]
                 for layer, per_kv in enumerate(c)]
                for c in make_steppers(full, runs, P, keys, values, "mean", 0, queries)]
    decoder = Decoder(net, full, P, steppers, keys, values, BUDGET, queries)
    for _ in range(P, T):
        decoder.step(logits=False)
    assert len(log) == len(runs) * len(full.global_layers) * H_kv * (T - P)
    assert max(n for _, n in log) == BUDGET


def test_an_unknown_layer_type_is_refused_before_any_token_runs():
    net = catalog.tiny_model("gemma3_text", 64)
    net.config.layer_types = ["sliding_attention", "chunked_attention"] * 2
    with pytest.raises(KvsimError) as info:
        attach(net)
    assert str(info.value) == ("model: expected layer types kvsim runs (full_attention, "
                               "sliding_attention) in config.layer_types, got "
                               "'chunked_attention'")


def test_a_window_the_config_does_not_declare_is_refused():
    net = catalog.tiny_model("gemma3_text", 64)
    attach(net)
    net.model.layers[1].self_attn.sliding_window = 4  # a global layer, by its layer type
    with pytest.raises(KvsimError, match=r"^model: layer 1 attends with a sliding window of "
                                         r"4, expected 0 as its config declares$"):
        prefill(net, np.arange(8))


def test_another_family_is_tried_with_a_warning():
    torch.manual_seed(0)
    config = transformers.OlmoConfig(**catalog.TINY, max_position_embeddings=64,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
    net = transformers.OlmoForCausalLM(config).eval()
    ids = np.random.default_rng(0).integers(0, catalog.TINY["vocab_size"], T)
    eager, _ = stock(net, ids)
    with pytest.warns(UnsupportedFamilyWarning, match="'olmo' is not one kvsim has been "
                                                      "checked on"):
        attach(net)
    assert np.abs(prefill(net, ids).logits - eager).max() < 1e-4
