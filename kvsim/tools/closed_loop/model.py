"""A Hugging Face causal LM with kvsim's caches inside it: the two passes of the closed loop.

One attention function, registered with transformers' attention interface, serves both:

- :func:`prefill` runs the whole text with full causal attention and records every layer's
  post-RoPE queries, keys and values. transformers passes a registered attention function
  no mask (it treats it like SDPA, with an implicit causal flag), so this pass applies
  causality itself; without it the prompt would silently attend to the future. It applies
  each layer's own geometry too, as the model passes it (:class:`Geometry`): its scaling
  (Gemma: ``query_pre_attn_scalar ** -0.5``), its logit softcap if any, and on a
  sliding-window layer (Gemma-3: five in six) the window, which the mask would carry.
- :class:`Decoder` then decodes the text one token at a time (teacher forcing) for ``C``
  compressed caches at once: every layer and KV head of every cache holds the positions its
  policy keeps; the model attends over those only, and the policy observes the attention the
  model computed under its compressed cache. The keys live in a full-length store with a
  membership mask, which gives the same numbers as evicting them physically.

On a sliding-window layer the model's own window already bounds the cache: policies compress the global layers only, and every cache, the full one included,
attends over exactly the window ``t - W < s <= t`` there, as the stock model does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import numpy as np

from kvsim.errors import KvsimError

ATTENTION = "kvsim_closed_loop"
_ACTIVE: list[Callable] = []  # the pass the registered attention function serves


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise KvsimError('closed-loop needs torch and transformers: pip install -e ".[capture]"') \
            from None
    return torch


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


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
               sliding_window=None, softcap=None, **kwargs):
    """The registered attention function: hands the layer's tensors and geometry (what the
    model passes: the mask it would build is not passed) to the active pass."""
    if scaling is None:  # transformers' default
        scaling = module.head_dim ** -0.5
    geometry = Geometry(float(scaling), int(sliding_window or 0), float(softcap or 0.0))
    return _ACTIVE[-1](module.layer_idx, query, key, value, geometry)


def attach(net) -> None:
    """Route ``net``'s attention through kvsim's function (used by both passes)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _attention)
    net.set_attn_implementation(ATTENTION)


class CachePolicy(Protocol):
    """What the decoder needs of a policy (:class:`kvsim.policies.stepping.Stepper`)."""

    cache: np.ndarray

    def admit(self, t: int) -> int: ...

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None: ...


@dataclass
class FullRun:
    """The full-cache run of the text: what every compressed run is compared with.

    ``queries`` (L, H, T, d), ``keys`` (L, H_kv, T, d), ``values`` (L, H_kv, T, dv) float32,
    post-RoPE; ``geometry``: each layer's :class:`Geometry`; ``logits`` (T, V) float32;
    ``attn_out_norm`` (L, T): the norm of each layer's attention block output (after the
    output projection), per position.
    """

    token_ids: np.ndarray
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    geometry: tuple[Geometry, ...]
    logits: np.ndarray
    attn_out_norm: np.ndarray

    @property
    def global_layers(self) -> list[int]:
        """The layers a policy compresses: those without a sliding window."""
        return [layer for layer, g in enumerate(self.geometry) if not g.window]

    @property
    def T(self) -> int:
        return self.token_ids.shape[0]

    @property
    def group(self) -> int:
        return self.queries.shape[1] // self.keys.shape[1]

    def prompt_attention(self, layer: int, kv_head: int, prompt_len: int) -> np.ndarray:
        """(G, P, P) float64 causal softmax of the prompt queries of one KV head's group
        (a global layer's: a window is not applied)."""
        G, g = self.group, self.geometry[layer]
        q = self.queries[layer, kv_head * G:(kv_head + 1) * G, :prompt_len].astype(np.float64)
        k = self.keys[layer, kv_head, :prompt_len].astype(np.float64)
        logits = q @ k.T
        logits *= g.scaling
        if g.softcap:
            logits /= g.softcap
            np.tanh(logits, out=logits)
            logits *= g.softcap
        return causal_softmax(logits, out=logits)


def causal_softmax(logits: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Row softmax over keys ``k <= q`` of a (..., n, n) logit array (float64), into
    ``out`` if given (``logits`` itself may be ``out``: the same numbers, no copies)."""
    n = logits.shape[-1]
    if out is None:
        out = np.empty_like(logits)
    np.copyto(out, logits)
    np.copyto(out, -np.inf, where=~np.tri(n, dtype=bool))
    out -= out.max(axis=-1, keepdims=True)
    np.exp(out, out=out)
    out /= out.sum(axis=-1, keepdims=True)
    return out


def prefill(net, token_ids: np.ndarray, logits_to_keep: int = 0) -> FullRun:
    """Run ``token_ids`` once with full causal attention through kvsim's attention function
    (``logits_to_keep``: the logits of the last positions only; 0: every position)."""
    torch = _torch()
    L = net.config.num_hidden_layers
    seen: dict[int, tuple] = {}
    norms: dict[int, np.ndarray] = {}

    def full_causal(layer, query, key, value, geometry):
        B, H, T, d = query.shape
        H_kv = key.shape[1]
        q = query.view(B, H_kv, H // H_kv, T, d)
        logits = geometry.logits(q, key[:, :, None])
        hidden = torch.ones(T, T, dtype=torch.bool).triu(1)  # the trap: no mask is passed
        if geometry.window:
            hidden |= torch.ones(T, T, dtype=torch.bool).tril(-geometry.window)
        p = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1,
                          dtype=torch.float32).to(query.dtype)
        out = torch.matmul(p, value[:, :, None]).reshape(B, H, T, -1)
        seen[layer] = (query[0], key[0], value[0], geometry)
        return out.transpose(1, 2).contiguous(), None

    def record_norm(module, args, output):
        norms[module.layer_idx] = output[0][0].norm(dim=-1).double().numpy()

    hooks = [layer.self_attn.register_forward_hook(record_norm) for layer in net.model.layers]
    _ACTIVE.append(full_causal)
    try:
        with torch.no_grad():
            logits = net(torch.as_tensor(token_ids[None], dtype=torch.long), use_cache=False,
                         logits_to_keep=logits_to_keep).logits
    finally:
        _ACTIVE.pop()
        for hook in hooks:
            hook.remove()
    q, k, v = (torch.stack([seen[layer][i] for layer in range(L)]).float().numpy()
               for i in range(3))
    return FullRun(np.asarray(token_ids, np.int64), q, k, v,
                   tuple(seen[layer][3] for layer in range(L)), logits[0].float().numpy(),
                   np.stack([norms[layer] for layer in range(L)]))


def stores(full: FullRun, caches: int, prompt_len: int,
           capacity: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(L, C, H_kv, capacity, d) float32 key and value stores of ``caches`` caches (default
    capacity: the full run's T), prompt rows filled from the full run (the policies'
    prefill reads them)."""
    out = []
    for x in (full.keys, full.values):
        L, H_kv, T, d = x.shape
        store = np.zeros((L, caches, H_kv, capacity or T, d), np.float32)
        store[:, :, :, :prompt_len] = x[:, None, :, :prompt_len]
        out.append(store)
    return out[0], out[1]


class FullCache:
    """The full cache as a :class:`CachePolicy`: every position stays (the reference)."""

    def __init__(self, prompt_len: int):
        self.n = prompt_len

    @property
    def cache(self) -> np.ndarray:
        return np.arange(self.n, dtype=np.int64)

    def admit(self, t: int) -> int:
        self.n = t + 1
        return -1

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """Nothing to learn: the full cache keeps everything."""


class Decoder:
    """Teacher-forced decode of ``C`` compressed caches at once, from a shared full prefill.

    At step ``t`` each layer first writes the new key and value into the store, lets every
    policy admit ``t`` (evicting first when full), then holds each cache's keys in the
    policy's slot order: the model attends over exactly those, and the attention rows it
    computes are, as they stand, what the policy observes. The keys and values in slot order
    live in one compact buffer per layer, in which only the slots whose position changed
    are copied from the store (one per step and cache: the incoming key), instead of
    gathering every cached key at every step; the numbers are the same. On a
    sliding-window layer no policy runs: every cache attends over the window
    ``t - W < s <= t``.

    Parameters
    ----------
    net : the model, attached with :func:`attach`.
    full : the full-cache run (its prompt keys and values fill every cache's prefill).
    prompt_len : ``P``; decode steps are ``P .. T-1``.
    policies : ``policies[c][layer][kv_head]``, a :class:`CachePolicy` after its prefill
        (on a sliding-window layer: never read, may be None).
    keys, values : the stores of :func:`stores`, which the policies read (row ``t`` is
        written before ``admit(t)``), shared with the model's attention.
    width : the largest cache any policy holds (its budget; ``T`` for a full cache), on
        every global layer.
    """

    def __init__(self, net, full: FullRun, prompt_len: int, policies: list, keys: np.ndarray,
                 values: np.ndarray, width: int):
        torch = _torch()
        self.net, self.full, self.P, self.policies = net, full, prompt_len, policies
        self.keys, self.values = torch.from_numpy(keys), torch.from_numpy(values)
        C, H_kv = keys.shape[1], keys.shape[2]
        self.width = width
        self.slots = np.zeros((C, H_kv, width), np.int64)  # the last layer's, in slot order
        self.absent = np.ones((C, H_kv, 1, width), bool)   # slots beyond a cache's size
        self._absent = torch.from_numpy(self.absent)
        self.sizes = np.zeros((C, H_kv), np.int64)
        self._held: dict = {}  # global layer -> (positions, keys, values) in slot order
        self.t = prompt_len

    def step(self, tokens: np.ndarray | None = None, logits: bool = True) -> np.ndarray | None:
        """Decode position ``t`` in every cache, reading the full run's token ``t`` or each
        cache's own ``tokens[c]`` (generation); returns the (C, V) float32 next-token logits
        (``logits=False``: the model's body only, no output layer, and None)."""
        torch = _torch()
        C = len(self.policies)
        ids = torch.full((C, 1), int(self.full.token_ids[self.t]), dtype=torch.long) \
            if tokens is None else torch.as_tensor(np.asarray(tokens, np.int64)[:, None])
        pos = torch.full((C, 1), self.t, dtype=torch.long)
        _ACTIVE.append(self._attend)
        try:
            with torch.no_grad():
                if not logits:  # the caches fill the same way; the output layer is skipped
                    self.net.model(input_ids=ids, position_ids=pos, use_cache=False)
                    self.t += 1
                    return None
                out = self.net(input_ids=ids, position_ids=pos, use_cache=False).logits
        finally:
            _ACTIVE.pop()
        self.t += 1
        return out[:, 0].float().numpy()

    def _attend(self, layer, query, key, value, geometry):
        torch = _torch()
        t, C = self.t, query.shape[0]
        H, H_kv, d = query.shape[1], key.shape[1], key.shape[-1]
        K, V = self.keys[layer], self.values[layer]
        K[:, :, t] = key[:, :, 0]
        V[:, :, t] = value[:, :, 0]
        q = query[:, :, 0].reshape(C, H_kv, H // H_kv, d)
        if geometry.window:  # the model's own window, the same for every cache
            lo = max(0, t + 1 - geometry.window)
            p = torch.softmax(geometry.logits(q, K[:, :, lo:t + 1]), dim=-1,
                              dtype=torch.float32).to(query.dtype)
            return torch.matmul(p, V[:, :, lo:t + 1]).reshape(C, 1, H, -1), None
        width = self.width
        if layer not in self._held:  # no slot holds a position yet
            self._held[layer] = (np.full((C, H_kv, width), -1, np.int64),
                                 torch.zeros(C, H_kv, width, d, dtype=K.dtype),
                                 torch.zeros(C, H_kv, width, V.shape[-1], dtype=V.dtype))
        held, keys, vals = self._held[layer]
        slots = self.slots
        for c, per_layer in enumerate(self.policies):
            for j in range(H_kv):
                policy = per_layer[layer][j]
                policy.admit(t)
                cache = policy.cache
                n = cache.shape[0]
                if n > width:
                    raise AssertionError(f"cache of {n} keys exceeds its budget of {width}")
                slots[c, j, :n] = cache
                slots[c, j, n:] = -1
                self.absent[c, j, 0, :n] = False
                self.absent[c, j, 0, n:] = True
                self.sizes[c, j] = n
        c, j, s = np.nonzero((slots != held) & (slots >= 0))  # slots whose position changed
        if c.size:
            c, j, s, at = (torch.from_numpy(x) for x in (c, j, s, slots[c, j, s]))
            keys[c, j, s] = K[c, j, at]
            vals[c, j, s] = V[c, j, at]
        held[...] = slots
        logits = geometry.logits(q, keys)
        p = torch.softmax(logits.masked_fill(self._absent, float("-inf")), dim=-1,
                          dtype=torch.float32).to(query.dtype)
        out = torch.matmul(p, vals)                              # (C, H_kv, G, dv)
        rows, outs = p.double().numpy(), out.double().numpy()
        for c, per_layer in enumerate(self.policies):
            for j in range(H_kv):
                per_layer[layer][j].observe(rows[c, j, :, :self.sizes[c, j]], outs[c, j])
        return out.reshape(C, 1, H, -1), None
