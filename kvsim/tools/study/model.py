"""A Hugging Face causal LM with kvsim's caches inside it: the two passes of the closed loop.

Both run through kvsim's one attention function (:mod:`kvsim.models.adapter`, attached by
:func:`~kvsim.models.adapter.attach`), each as the pass it serves:

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

On a sliding-window layer the model's own window already bounds the cache: policies compress
the global layers only, and every cache, the full one included, attends over exactly the
window ``t - W < s <= t`` there, as the stock model does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.quantize import Quantize, quantised_counts
from kvsim.models.adapter import Geometry, forward, hidden_keys, rope_settings, serving
from kvsim.models.preflight import INSTALL


def _torch():
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError:
        raise KvsimError(f"closed-loop needs torch and transformers: {INSTALL}") from None
    return torch


class CachePolicy(Protocol):
    """What the decoder needs of a policy (:class:`kvsim.protocols.stepping.Stepper`)."""

    cache: np.ndarray

    def admit(self, t: int) -> int: ...

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None: ...


@dataclass
class FullRun:
    """The full-cache run of the text: what every compressed run is compared with.

    ``queries`` (L, H, T, d), ``keys`` (L, H_kv, T, d), ``values`` (L, H_kv, T, dv) float32,
    post-RoPE; ``geometry``: each layer's :class:`Geometry`; ``logits`` (T, V) float32;
    ``attn_out_norm`` (L, T): the norm of each layer's attention block output (after the
    output projection), per position; where asked (:func:`prefill`'s ``rope``),
    ``pre_rope_queries`` (L, H, T, d) float32, the queries before RoPE, and ``rope``, each
    layer's (inverse frequencies, cos/sin factor).
    """

    token_ids: np.ndarray
    queries: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    geometry: tuple[Geometry, ...]
    logits: np.ndarray
    attn_out_norm: np.ndarray
    pre_rope_queries: np.ndarray | None = None
    rope: tuple = ()

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

    def layer_attention(self, layer: int, prompt_len: int) -> np.ndarray:
        """(H_kv, G, P, P) float64: :meth:`prompt_attention` of every KV head of a global
        layer, what a :class:`~kvsim.protocols.stepping.Stepper` of a policy that chooses one
        set for the whole layer takes (``Policy.layer``)."""
        H_kv = self.keys.shape[1]
        out = np.empty((H_kv, self.group, prompt_len, prompt_len))
        for j in range(H_kv):
            out[j] = self.prompt_attention(layer, j, prompt_len)
        return out

    def prompt_rope(self, layer: int, kv_head: int, prompt_len: int) -> tuple | None:
        """(pre-RoPE prompt queries (G, P, d), inverse frequencies, cos/sin factor) of one
        KV head's group, what :class:`~kvsim.protocols.stepping.Stepper` takes as ``rope``;
        None unless :func:`prefill` recorded them."""
        if self.pre_rope_queries is None:
            return None
        G = self.group
        return (self.pre_rope_queries[layer, kv_head * G:(kv_head + 1) * G, :prompt_len],
                *self.rope[layer])


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


def prefill(net, token_ids: np.ndarray, logits_to_keep: int = 0, rope: bool = False
            ) -> FullRun:
    """Run ``token_ids`` once with full causal attention through kvsim's attention function
    (``logits_to_keep``: the logits of the last positions only; 0: every position); with
    ``rope``, record the queries before RoPE and each layer's RoPE too."""
    torch = _torch()
    L = net.config.num_hidden_layers
    seen: dict[int, tuple] = {}
    norms: dict[int, np.ndarray] = {}
    pre: dict | None = {} if rope else None

    def full_causal(layer, query, key, value, geometry):
        B, H, T, d = query.shape
        H_kv = key.shape[1]
        q = query.view(B, H_kv, H // H_kv, T, d)
        logits = geometry.logits(q, key[:, :, None])
        hidden = hidden_keys(T, geometry.window)  # the trap: no mask is passed
        p = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1,
                          dtype=torch.float32).to(query.dtype)
        out = torch.matmul(p, value[:, :, None]).reshape(B, H, T, -1)
        seen[layer] = (query[0], key[0], value[0], geometry)
        return out.transpose(1, 2).contiguous(), None

    logits = forward(net, token_ids, full_causal, logits_to_keep, pre, norms)
    q, k, v = (torch.stack([seen[layer][i] for layer in range(L)]).float().numpy()
               for i in range(3))
    return FullRun(np.asarray(token_ids, np.int64), q, k, v,
                   tuple(seen[layer][3] for layer in range(L)), logits[0].float().numpy(),
                   np.stack([norms[layer] for layer in range(L)]),
                   torch.stack([pre[layer] for layer in range(L)]).numpy() if rope else None,
                   tuple(rope_settings(net, layer.self_attn)[:2] for layer in net.model.layers)
                   if rope else ())


def stores(full: FullRun, caches: int, prompt_len: int, capacity: int | None = None,
           keys_for: list[int] | None = None, values_for: list[int] | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """(L, C, H_kv, capacity, d) float32 key and value stores of ``caches`` caches (default
    capacity: the full run's T). The prompt rows are the full run's; they are copied into
    the stores of the caches ``keys_for`` and ``values_for`` only (default: all), those
    whose policy reads them, and in the global layers only, where policies run:
    :class:`Decoder` reads prompt positions from the full run, and rows nobody writes take
    no memory."""
    out = []
    layers = full.global_layers
    for x, wanted in ((full.keys, keys_for), (full.values, values_for)):
        L, H_kv, T, d = x.shape
        store = np.zeros((L, caches, H_kv, capacity or T, d), np.float32)
        for c in range(caches) if wanted is None else wanted:
            store[layers, c, :, :prompt_len] = x[layers, :, :prompt_len]
        out.append(store)
    return out[0], out[1]


def query_stores(full: FullRun, caches: list[int], prompt_len: int,
                 capacity: int | None = None) -> dict[int, np.ndarray]:
    """(L, H_kv, G, capacity, d) float32 query stores of the caches ``caches`` (those whose
    policy reads query vectors), prompt rows filled from the full run in the global layers
    (where policies run)."""
    L, H, T, d = full.queries.shape
    H_kv = full.keys.shape[1]
    layers = full.global_layers
    prompt = full.queries[layers, :, :prompt_len].reshape(len(layers), H_kv, H // H_kv,
                                                         prompt_len, d)
    out = {}
    for c in caches:
        out[c] = np.zeros((L, H_kv, H // H_kv, capacity or T, d), np.float32)
        out[c][layers, :, :, :prompt_len] = prompt
    return out


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


@dataclass
class Kept:
    """A cache that holds given context positions and every later one (no eviction):
    kvpress's decode after its prefill compressed the context, as a :class:`CachePolicy`."""

    positions: list

    @property
    def cache(self) -> np.ndarray:
        return np.asarray(self.positions, np.int64)

    def admit(self, t: int) -> int:
        self.positions.append(t)
        return -1

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """Nothing to learn: kvpress does not evict after the prefill."""


def _dequantised_groups(x, dim: int, bits: int):
    """KIVI's groups of float64 tensor ``x`` along ``dim`` (one group per slice): codes
    ``round_half_even(clip((x - lo) / s, 0, 2^b - 1))`` read back as ``code * s + lo``; a
    constant group reads back ``lo`` (the arithmetic of
    :func:`kvsim.numerics.quantize.dequantised`, vectorised)."""
    torch = _torch()
    levels = 2.0 ** bits - 1.0
    lo, hi = x.amin(dim=dim, keepdim=True), x.amax(dim=dim, keepdim=True)
    s = (hi - lo) / levels
    code = torch.round(((x - lo) / s).clamp(0.0, levels))  # torch.round: half to even
    return torch.where(s == 0.0, lo, code * s + lo)


def kivi_store(keys, values, slots: np.ndarray, quant: Quantize) -> None:
    """One cache's gathered keys (width, d) and values (width, dv) (torch, slot order; the
    first ``len(slots)`` in use) as KIVI stores them, in place: the rule of
    :mod:`kvsim.numerics.quantize` over the cached positions in order."""
    torch = _torch()
    n = slots.shape[0]
    n_keys, n_values = quantised_counts(n, quant.residual)
    order = torch.from_numpy(np.argsort(slots))
    G = quant.group
    if n_keys:  # per channel: groups of G slots
        at = order[:n_keys]
        k = keys[at].double()
        keys[at] = _dequantised_groups(k.view(n_keys // G, G, -1), 1, quant.bits).view(
            n_keys, -1).to(keys.dtype)
    if n_values:  # per token: groups of G channels
        at = order[:n_values]
        v = values[at].double()
        values[at] = _dequantised_groups(v.view(n_values, -1, G), 2, quant.bits).view(
            n_values, -1).to(values.dtype)


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
    keys, values : the stores of :func:`stores`, which the policies read: each cache's
        rows from ``prompt_len`` on (row ``t`` is written before ``admit(t)``), which the
        model attends over too; it reads the positions before ``prompt_len`` from ``full``.
    width : the largest cache any policy holds (its budget; ``T`` for a full cache), on
        every global layer.
    queries : the stores of :func:`query_stores` (cache -> store), row ``t`` written before
        ``admit(t)`` like the keys'.
    storage : per cache, its KIVI settings (its keys and values quantised on global layers
        as :func:`kivi_store` does, at every step) or None (16-bit; the default for all).
    """

    def __init__(self, net, full: FullRun, prompt_len: int, policies: list, keys: np.ndarray,
                 values: np.ndarray, width: int, queries: dict | None = None,
                 storage: list | None = None):
        torch = _torch()
        self.net, self.full, self.P, self.policies = net, full, prompt_len, policies
        self.keys, self.values = torch.from_numpy(keys), torch.from_numpy(values)
        self.prompt_keys = torch.from_numpy(full.keys)  # positions < prompt_len: shared
        self.prompt_values = torch.from_numpy(full.values)
        self.queries = {c: torch.from_numpy(q) for c, q in (queries or {}).items()}
        C, H_kv = keys.shape[1], keys.shape[2]
        self.width = width
        self.slots = np.zeros((C, H_kv, width), np.int64)  # the last layer's, in slot order
        self.sizes = np.zeros((C, H_kv), np.int64)
        self._columns = np.arange(width)
        self._bias = np.zeros((C, H_kv, 1, width), np.float32)  # -inf beyond a cache's size
        self._torch_bias = torch.from_numpy(self._bias)
        self._held: dict = {}  # global layer -> (positions, keys, values) in slot order
        self.t = prompt_len
        self.storage = storage or [None] * C

    def step(self, tokens: np.ndarray | None = None, logits: bool = True) -> np.ndarray | None:
        """Decode position ``t`` in every cache, reading the full run's token ``t`` or each
        cache's own ``tokens[c]`` (generation); returns the (C, V) float32 next-token logits
        (``logits=False``: the model's body only, no output layer, and None)."""
        torch = _torch()
        C = len(self.policies)
        ids = torch.full((C, 1), int(self.full.token_ids[self.t]), dtype=torch.long) \
            if tokens is None else torch.as_tensor(np.asarray(tokens, np.int64)[:, None])
        pos = torch.full((C, 1), self.t, dtype=torch.long)
        with serving(self._attend), torch.no_grad():
            if not logits:  # the caches fill the same way; the output layer is skipped
                self.net.model(input_ids=ids, position_ids=pos, use_cache=False)
                self.t += 1
                return None
            out = self.net(input_ids=ids, position_ids=pos, use_cache=False).logits
        self.t += 1
        return out[:, 0].float().numpy()

    def _window(self, store, shared, lo: int, t: int):
        """Every cache's rows ``lo .. t`` of ``store`` (C, H_kv, T, d), those before the
        prompt's end from ``shared`` (H_kv, T, d), the full run's."""
        if lo >= self.P:
            return store[:, :, lo:t + 1]
        C = store.shape[0]
        return _torch().cat((shared[None, :, lo:self.P].expand(C, -1, -1, -1),
                             store[:, :, self.P:t + 1]), dim=2)

    def _attend(self, layer, query, key, value, geometry):
        torch = _torch()
        t, C = self.t, query.shape[0]
        H, H_kv, d = query.shape[1], key.shape[1], key.shape[-1]
        K, V = self.keys[layer], self.values[layer]
        K[:, :, t] = key[:, :, 0]
        V[:, :, t] = value[:, :, 0]
        q = query[:, :, 0].reshape(C, H_kv, H // H_kv, d)
        for c, Q in self.queries.items():
            Q[layer, :, :, t] = q[c]
        if geometry.window:  # the model's own window, the same for every cache
            lo = max(0, t + 1 - geometry.window)
            k_win, v_win = (self._window(x, shared[layer], lo, t)
                            for x, shared in ((K, self.prompt_keys), (V, self.prompt_values)))
            p = torch.softmax(geometry.logits(q, k_win), dim=-1,
                              dtype=torch.float32).to(query.dtype)
            return torch.matmul(p, v_win).reshape(C, 1, H, -1), None
        width = self.width
        if layer not in self._held:  # no slot holds a position yet
            self._held[layer] = (np.full((C, H_kv, width), -1, np.int64),
                                 torch.zeros(C, H_kv, width, d, dtype=K.dtype),
                                 torch.zeros(C, H_kv, width, V.shape[-1], dtype=V.dtype))
        held, keys, vals = self._held[layer]
        slots, sizes = self.slots, self.sizes
        for c, per_layer in enumerate(self.policies):
            for j, policy in enumerate(per_layer[layer]):
                policy.admit(t)
                cache = policy.cache
                n = cache.shape[0]
                if n > width:
                    raise AssertionError(f"cache of {n} keys exceeds its budget of {width}")
                slots[c, j, :n] = cache
                sizes[c, j] = n
        beyond = self._columns >= sizes[:, :, None]
        slots[beyond] = -1
        self._bias[:, :, 0] = np.where(beyond, -np.inf, 0.0)
        c, j, s = np.nonzero((slots != held) & (slots >= 0))  # slots whose position changed
        if c.size:
            at = slots[c, j, s]
            prompt = at < self.P
            if prompt.any():  # the full run's rows
                cp, jp, sp, ap = (torch.from_numpy(x[prompt]) for x in (c, j, s, at))
                keys[cp, jp, sp] = self.prompt_keys[layer, jp, ap]
                vals[cp, jp, sp] = self.prompt_values[layer, jp, ap]
            if not prompt.all():  # each cache's own rows
                cd, jd, sd, ad = (torch.from_numpy(x[~prompt]) for x in (c, j, s, at))
                keys[cd, jd, sd] = K[cd, jd, ad]
                vals[cd, jd, sd] = V[cd, jd, ad]
        held[...] = slots
        if any(quant is not None for quant in self.storage):  # KIVI reads a copy; the
            keys, vals = keys.clone(), vals.clone()             # buffers stay exact
            for c, quant in enumerate(self.storage):
                for j in range(H_kv) if quant is not None else ():
                    kivi_store(keys[c, j], vals[c, j], slots[c, j, :self.sizes[c, j]], quant)
        logits = geometry.logits(q, keys)
        p = torch.softmax(logits + self._torch_bias, dim=-1,  # + 0 or -inf: a mask
                          dtype=torch.float32).to(query.dtype)
        out = torch.matmul(p, vals)                              # (C, H_kv, G, dv)
        rows, outs = p.double().numpy(), out.double().numpy()
        n = sizes.tolist()
        for c, per_layer in enumerate(self.policies):
            for j, policy in enumerate(per_layer[layer]):
                policy.observe(rows[c, j, :, :n[c][j]], outs[c, j])
        return out.reshape(C, 1, H, -1), None
