"""The one way into a Hugging Face causal LM, for capture and the closed loop alike.

- :func:`attach` routes the model's attention through one function registered with
  transformers' attention interface, after checking the model: its family (one of
  :data:`kvsim.models.catalog.FAMILIES`, else an :class:`UnsupportedFamilyWarning`) and each
  layer's type (``config.layer_types``: full or sliding-window attention; any other type is
  a one-line :class:`KvsimError`).
- That function hands each layer's post-RoPE query, key and value, with the layer's
  :class:`Geometry`, to the active pass (:func:`serving`): capture's recording pass, the
  closed loop's full prefill, or its decoder. It checks the window the model passes
  against the one ``config.layer_types`` gives the layer.
- :func:`forward` runs a text through the model under a pass, computing each layer's
  queries before RoPE from its projections (:func:`pre_rope_queries`) and the norm of its
  attention output, where asked.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import numpy as np

from kvsim.errors import KvsimError
from kvsim.models import catalog

ATTENTION = "kvsim"
_ACTIVE: list[Callable] = []  # the pass the registered attention function serves


class UnsupportedFamilyWarning(UserWarning):
    """A model of a family kvsim has not been checked on (:data:`catalog.FAMILIES`)."""


@dataclass(frozen=True)
class Geometry:
    """How one layer turns ``q . k`` into attention: ``logits = q . k * scaling``, then
    ``softcap * tanh(logits / softcap)`` if ``softcap``, over the keys ``s <= t`` (and
    ``s > t - window`` on a sliding-window layer, ``window`` > 0)."""

    scaling: float
    window: int = 0
    softcap: float = 0.0

    def logits(self, q, k):
        """``q @ k^T`` scaled and softcapped (torch tensors)."""
        x = q.matmul(k.transpose(-1, -2)) * self.scaling
        return (x / self.softcap).tanh() * self.softcap if self.softcap else x


def windows(config) -> list[int]:
    """Each layer's sliding window (0: full attention) as the config declares it:
    ``config.layer_types`` where present (a ``sliding_attention`` layer has
    ``config.sliding_window``), else ``config.sliding_window`` on every layer (Mistral,
    Phi-3) or none (Llama). A layer type other than :data:`catalog.LAYER_TYPES` is a
    :class:`KvsimError`."""
    window = int(getattr(config, "sliding_window", None) or 0)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [window] * config.num_hidden_layers
    problem = catalog.layer_types_problem(types)
    if problem:
        raise KvsimError(f"model: {problem}")
    return [window if t == "sliding_attention" else 0 for t in types]


def _attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
               sliding_window=None, softcap=None, **kwargs):
    """The registered attention function: hands the layer's tensors and geometry (what the
    model passes: the mask it would build is not passed) to the active pass. Its arguments
    are in SDPA's order (``dropout`` sixth): importing kvpress wraps every registered
    attention function in one that passes ``dropout`` by position."""
    if scaling is None:  # transformers' default
        scaling = module.head_dim ** -0.5
    geometry = Geometry(float(scaling), int(sliding_window or 0), float(softcap or 0.0))
    declared = windows(module.config)[module.layer_idx]
    if geometry.window != declared:
        raise KvsimError(f"model: layer {module.layer_idx} attends with a sliding window of "
                         f"{geometry.window}, expected {declared} as its config declares")
    return _ACTIVE[-1](module.layer_idx, query, key, value, geometry)


def attach(net) -> None:
    """Route ``net``'s attention through kvsim's function, once its layers are checked:
    each one's type (:func:`windows`; refused before any token runs) and its family
    (outside :data:`catalog.FAMILIES`: a warning, and kvsim tries it)."""
    from transformers import AttentionInterface

    if not hasattr(getattr(net, "model", None), "layers"):
        raise KvsimError(f"model: expected a causal LM with its layers at model.layers, got "
                         f"{type(net).__name__}")
    windows(net.config)
    family = getattr(net.config, "model_type", None)
    if family not in catalog.FAMILIES:
        warnings.warn(f"model family {family!r} is not one kvsim has been checked on "
                      f"({', '.join(catalog.FAMILIES)}); trying it", UnsupportedFamilyWarning,
                      stacklevel=2)
    AttentionInterface.register(ATTENTION, _attention)
    net.set_attn_implementation(ATTENTION)


@contextmanager
def serving(attend: Callable):
    """While inside, the attention of an attached model calls ``attend(layer, query, key,
    value, geometry)``, which returns (output (B, T, H, dv), None)."""
    _ACTIVE.append(attend)
    try:
        yield
    finally:
        _ACTIVE.pop()


def hidden_keys(T: int, window: int = 0):
    """(T, T) torch bool mask, True where query ``t`` does not see key ``s``: ``s > t``,
    and on a sliding-window layer (``window`` > 0) ``s <= t - window``. transformers passes
    a registered attention function no mask, so every pass over a whole text applies it."""
    import torch

    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
    if window:
        hidden |= torch.ones(T, T, dtype=torch.bool).tril(-window)
    return hidden


def pre_rope_queries(attention, hidden):
    """(B, H, T, d) queries of one attention layer before RoPE, from its input ``hidden``
    (B, T, D), as the layer computes them: its query projection (Phi-3: the query part of
    ``qkv_proj``), viewed as heads and transposed, then its query norm where it has one
    (Gemma-3, Qwen3), as kvpress's ``get_prerope_query_states`` does."""
    B, T, _ = hidden.shape
    H, d = attention.config.num_attention_heads, attention.head_dim
    proj = getattr(attention, "q_proj", None)
    q = proj(hidden) if proj is not None else attention.qkv_proj(hidden)[..., :H * d]
    q = q.view(B, T, H, d).transpose(1, 2)
    norm = getattr(attention, "q_norm", None)
    return norm(q) if norm is not None else q


def forward(net, token_ids: np.ndarray, attend: Callable, logits_to_keep: int = 0,
            queries: dict | None = None, norms: dict | None = None):
    """Run ``token_ids`` through the attached ``net`` once, its attention served by
    ``attend`` (:func:`serving`), no cache kept; returns the (1, T or ``logits_to_keep``, V)
    logits. Before each layer attends, its (H, T, d) queries before RoPE go into
    ``queries[layer]`` (:func:`pre_rope_queries`); after, the (T,) float64 norm of its
    attention output (after the output projection) into ``norms[layer]``, where given."""
    import torch

    def before(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        queries[module.layer_idx] = pre_rope_queries(module, hidden)[0]

    def after(module, args, output):
        norms[module.layer_idx] = output[0][0].norm(dim=-1).double().numpy()

    hooks = []
    for layer in net.model.layers:
        if queries is not None:
            hooks.append(layer.self_attn.register_forward_pre_hook(before, with_kwargs=True))
        if norms is not None:
            hooks.append(layer.self_attn.register_forward_hook(after))
    try:
        with serving(attend), torch.no_grad():
            return net(torch.as_tensor(np.asarray(token_ids)[None], dtype=torch.long),
                       use_cache=False, logits_to_keep=logits_to_keep).logits
    finally:
        for hook in hooks:
            hook.remove()


def rope_settings(net, attention) -> tuple[np.ndarray, float, float]:
    """(inverse frequencies, cos/sin factor, base theta or NaN) of one attention layer's
    RoPE, from the model's rotary embedding (per layer type where it has several: Gemma-3
    rotates its local layers with base 10,000 and its global ones with 1,000,000)."""
    rotary = getattr(net.model, "rotary_emb", None)
    if rotary is None:
        raise KvsimError("model: expected a model with a rotary embedding (model.rotary_emb)")
    kind = getattr(attention, "layer_type", None)
    freq = getattr(rotary, f"{kind}_inv_freq", None) if kind else None
    if freq is None:
        freq, factor = rotary.inv_freq, rotary.attention_scaling
    else:
        factor = getattr(rotary, f"{kind}_attention_scaling")
    params = getattr(net.config, "rope_parameters", None) or {}
    params = params.get(kind, params) if kind else params
    theta = float(params.get("rope_theta", getattr(net.config, "rope_theta", np.nan)))
    return freq.detach().numpy().astype(np.float64), float(factor), theta
