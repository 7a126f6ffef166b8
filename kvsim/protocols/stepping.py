"""Drive a policy one step at a time from Python, on attention rows from elsewhere.

The :class:`Stepper` runs the very ``admit``/``observe`` code that the simulator's decode
loop runs (:mod:`kvsim.numerics.decode`), so fed the simulator's rows it reproduces the
simulator's cache at every step; fed a real model's rows under its compressed cache, it is
the policy in a closed loop.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from kvsim.errors import KvsimError
from kvsim.numerics.field import dense_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.numerics.lanes import lane_sum
from kvsim.policies.layout import widen
from kvsim.protocols import settings
from kvsim.protocols.cache import Run
from kvsim.protocols.pages import page_evict, page_prefill
from kvsim.protocols.run import get_policy, make_group, resolve_params, run_problems
from kvsim.protocols.uniform import LayerRun, layer_prefill


def _array(name: str, value, ndim: int) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.ndim != ndim:
        raise KvsimError(f"{name}: expected a {ndim}-D NumPy array, got "
                         f"{getattr(value, 'shape', type(value).__name__)}")
    return value


def _with_rope(field, rope, G: int, P: int, policy: str):
    """``field`` with the prompt's pre-RoPE queries and the RoPE settings ``rope``."""
    if rope is None:
        raise KvsimError(f"rope: {policy} needs the prompt's pre-RoPE queries and the RoPE "
                         f"settings, got none")
    queries, freq, scale = rope
    queries = _array("rope queries", queries, 3)
    freq = np.ascontiguousarray(_array("rope frequencies", freq, 1), dtype=np.float64)
    if queries.shape[:2] != (G, P) or not 1 <= 2 * freq.shape[0] <= queries.shape[2]:
        raise KvsimError(f"rope: expected queries of shape ({G}, {P}, d) and at most d/2 "
                         f"frequencies, got {queries.shape} and {freq.shape[0]}")
    return field._replace(pre_rope_queries=np.ascontiguousarray(queries, dtype=np.float32),
                          rope_freq=freq, rope_scale=float(scale))


def _layer_attention(prompt_attention, kv_head, policy: str, layer: bool
                     ) -> tuple[np.ndarray, int, int]:
    """(the (H, P, P) attention the stepper's field holds, its KV heads, the stepper's KV
    head among them) from ``prompt_attention``: (G, P, P), or with ``kv_head`` the layer's
    (H_kv, G, P, P); a policy that reads the ``layer`` needs the latter."""
    if kv_head is None:
        if layer:
            raise KvsimError(f"prompt_attention: {policy} chooses one set for the layer from "
                             f"every KV head's attention: expected the layer's (H_kv, G, P, "
                             f"P) and kv_head, got {getattr(prompt_attention, 'shape', None)} "
                             f"and no kv_head")
        A = _array("prompt_attention", prompt_attention, 3)
        if A.shape[0] < 1 or A.shape[2] != A.shape[1]:
            raise KvsimError(f"prompt_attention: expected shape (G, P, P) with G >= 1, got "
                             f"{A.shape}")
        return A, 1, 0
    A = _array("prompt_attention", prompt_attention, 4)
    if min(A.shape[:2]) < 1 or A.shape[3] != A.shape[2]:
        raise KvsimError(f"prompt_attention: expected shape (H_kv, G, P, P) with H_kv, G >= "
                         f"1, got {A.shape}")
    if isinstance(kv_head, bool) or not isinstance(kv_head, (int, np.integer)) \
            or not 0 <= kv_head < A.shape[0]:
        raise KvsimError(f"kv_head: expected an integer in [0, {A.shape[0]}), got {kv_head!r}")
    return A.reshape(A.shape[0] * A.shape[1], *A.shape[2:]), A.shape[0], int(kv_head)


class Stepper:
    """One KV head's cache under ``policy``, advanced one token at a time.

    Parameters
    ----------
    policy, budget, params : a registered policy, its budget and parameters.
    prompt_attention : (G, P, P) float64, the full causal attention of the P prompt
        queries of the G query heads sharing this KV head (rows sum to 1 over k <= q);
        P may be 0. The prefill selection is made from it exactly as the simulator makes it.
        With ``kv_head``: (H_kv, G, P, P), the attention of every KV head's group of the
        layer, this stepper's being ``prompt_attention[kv_head]``; a policy that chooses one
        set for the whole layer (``Policy.layer``: ``chunkkv``) needs it, so that each KV
        head's stepper makes the layer's choice as the simulator does.
    keys, values : (capacity_T, d) arrays of the KV head, read by reference (not copied),
        so rows may be filled as tokens arrive; a policy reads rows ``< t + 1`` only. A
        policy's ``start`` sees them as ``prompt.keys`` (by dimension, ``keys.T``) and
        ``prompt.values``.
    queries : (G, capacity_T, d) query vectors of the group's heads, by reference like
        ``keys`` (row ``t`` filled before ``admit(t)``), for policies that need them
        (``rkv``); ``scaling`` (a number or (G,)) turns ``q . k`` into a logit (default
        ``d ** -0.5``).
    gqa : how the group's scores combine ("mean", "max", "sum").
    seed : the seed of seeded policies (``random``).
    capacity_T : the largest position + 1 that will ever be admitted.
    rope : for policies that need them (``expected_attention``): the (G, P, d) queries of
        the prompt before RoPE (with ``kv_head``: the layer's, (H_kv * G, P, d)), the RoPE
        inverse frequencies (n,) and the cos/sin factor
        (see :class:`kvsim.numerics.field.FieldData`).
    passes : a memo of the full passes over ``prompt_attention``, shared by the steppers
        built on the very same array (each policy and budget of one KV head; with
        ``kv_head``, of the layer) so that its column sums are computed once; None: a memo
        of its own.

    Raises
    ------
    KvsimError
        For a bad argument, or a policy that cannot run in a closed loop (with the reason).
    """

    def __init__(self, policy: str, budget: int, params: dict | None = None, *,
                 prompt_attention: np.ndarray, keys: np.ndarray | None = None,
                 values: np.ndarray | None = None, queries: np.ndarray | None = None,
                 scaling=None, gqa: str = "mean", seed: int = 0, capacity_T: int,
                 rope: tuple | None = None, passes: dict | None = None,
                 kv_head: int | None = None):
        spec = get_policy(policy)
        resolved = resolve_params(spec, params or {})
        if settings.steps_in_model(resolved):
            raise KvsimError(f"{policy}.{settings.asked(resolved)[0]}: one KV head's stepper "
                             f"cannot run it: step the layer with UniformLayer")
        if spec.layer_cache is not None:
            raise KvsimError(f"{policy}: cannot run one step at a time: it evicts the same "
                             f"blocks from every KV head of a layer: step the layer with "
                             f"BlockLayer")
        for problem in run_problems(spec, resolved, stepping=True):  # the first one
            if problem.key:
                raise KvsimError(problem.message, f"{policy}.{problem.key}")
            raise KvsimError(f"{policy}: cannot run one step at a time: {problem.message}")
        A, H_kv, kv_head = _layer_attention(prompt_attention, kv_head, policy, spec.layer)
        G, P = A.shape[0] // H_kv, A.shape[1]
        _check_run(spec, policy, resolved, budget, capacity_T, P)
        if gqa not in GQA_MODES:
            raise KvsimError(f"gqa: expected one of {', '.join(GQA_MODES)}, got {gqa!r}")
        self._keys = self._vectors("keys", keys, capacity_T, policy, "keys" in spec.needs)
        self._values = self._vectors("values", values, capacity_T, policy,
                                     "values" in spec.needs)
        self._queries = self._query_vectors(queries, G, capacity_T, policy,
                                            "queries" in spec.needs)
        field = _prompt_field(A, H_kv)
        if "rope" in spec.needs:
            field = _with_rope(field, rope, G * H_kv, P, policy)
        prompt = make_group(field, kv_head, P, np.zeros((G * H_kv, max(P, 1)), bool),
                            {} if passes is None else passes, GQA_MODES[gqa], int(seed))
        empty = np.zeros((0, 0), np.float32)
        vectors = (empty if self._keys is None else self._keys.T,  # by dimension, like a field's
                   empty if self._values is None else self._values)
        if self._queries is not None:
            scale = self._queries.shape[2] ** -0.5 if scaling is None else scaling
            try:
                scale = np.broadcast_to(np.asarray(scale, np.float64), G).copy()
            except (TypeError, ValueError):
                raise KvsimError(f"scaling: expected a number or {G} numbers (one per query "
                                 f"head), got {scaling!r}") from None
            vectors += (self._queries, scale)
        prompt = dataclasses.replace(prompt, vectors=vectors)
        kept, self._state = spec.steps.start(prompt, int(budget), resolved, int(capacity_T))
        # A decode step reads vectors, never the prompt's attention: it is not kept alive.
        prompt = dataclasses.replace(prompt, field=field._replace(
            probs=np.zeros((G * H_kv, 0, 0))))
        self._steps, self._prompt, self._params = spec.steps, prompt, resolved
        self._name, self._needs, self._layout = policy, spec.needs, spec.layout
        self._cache = np.zeros(int(budget), np.int64)
        self._n = len(kept)
        self._cache[:self._n] = kept
        self._obs = np.zeros((G, int(budget)))
        self._mass = np.zeros(G)
        self._next = P  # the next token to admit
        self._capacity = int(capacity_T)
        self._observed = True
        self._policy, self._params, self._seed = policy, resolved, int(seed)

    def widen(self, extra: int) -> None:
        """``extra`` more cache slots from now on, the fixed parts (recent tokens, sinks,
        windows) unchanged: the question of the ``before_question`` protocol
        (:func:`kvsim.policies.layout.widen`, as the policy's layout declares)."""
        if self._layout is None:
            raise KvsimError(f"{self._policy}: cannot widen: it declares no state layout "
                             f"(Policy.layout)")
        budget = self._cache.shape[0]
        self._state = widen(self._state, self._layout, self._params, budget, extra,
                            self._seed)
        self._cache = np.concatenate((self._cache, np.zeros(extra, np.int64)))
        self._obs = np.zeros((self._obs.shape[0], budget + extra))

    @staticmethod
    def _vectors(name: str, x, capacity_T: int, policy: str, needed: bool):
        """A (capacity_T, d) array by reference, or None; an error if needed and missing."""
        if x is None:
            if needed:
                raise KvsimError(f"{name}: {policy} needs the {name} of the KV head, got none")
            return None
        x = _array(name, x, 2)
        if x.shape[0] != capacity_T:
            raise KvsimError(f"{name}: expected {capacity_T} rows (capacity_T), got {x.shape[0]}")
        return x

    @staticmethod
    def _query_vectors(x, G: int, capacity_T: int, policy: str, needed: bool):
        """A (G, capacity_T, d) array by reference, or None; an error if needed and missing."""
        if x is None:
            if needed:
                raise KvsimError(f"queries: {policy} needs the query vectors of the group, "
                                 f"got none")
            return None
        x = _array("queries", x, 3)
        if x.shape[:2] != (G, capacity_T):
            raise KvsimError(f"queries: expected shape ({G}, {capacity_T}, d) (heads, "
                             f"capacity_T, d), got {x.shape}")
        return x

    @property
    def cache(self) -> np.ndarray:
        """The cached positions, in slot order."""
        return self._cache[:self._n].copy()

    def admit(self, t: int) -> int:
        """Token ``t`` joins (evicting first when full); returns the evicted position or -1."""
        if t != self._next or t >= self._capacity:
            raise KvsimError(f"admit: expected token {self._next} (tokens join in order, below "
                             f"capacity_T = {self._capacity}), got {t!r}")
        if not self._observed:
            raise KvsimError(f"admit: token {t - 1} was admitted but not observed")
        if self._steps.prepare is not None:
            self._steps.prepare(self._state, self._prompt, self._params, t)
        slot = int(self._steps.admit(self._state, self._cache, self._n, t))
        evicted = int(self._cache[slot]) if slot < self._n else -1
        self._n += slot == self._n
        self._cache[slot] = t
        self._next = t + 1
        self._observed = False
        return evicted

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """Query ``t`` (the last admitted token) attended over :attr:`cache`.

        ``attention``: (G, n) attention of each query head over the cache in slot order
        (renormalised here, so the full-cache rows restricted to the cache do too);
        ``output``: (G, dv) the observed outputs, for policies that need values.
        """
        if self._observed:
            raise KvsimError("observe: expected a token admitted first")
        G, n = self._obs.shape[0], self._n
        a = _array("attention", attention, 2)
        if a.shape != (G, n):
            raise KvsimError(f"attention: expected shape {(G, n)} (heads, cached keys), "
                             f"got {a.shape}")
        self._obs[:, :n] = a
        for g in range(G):
            self._mass[g] = lane_sum(self._obs[g], n)
        if output is None and "values" in self._needs:
            raise KvsimError(f"output: {self._name} needs the observed outputs (G, dv), got none")
        outputs = np.zeros((G, 0)) if output is None else np.ascontiguousarray(
            _array("output", output, 2), dtype=np.float64)
        if outputs.shape[0] != G:
            raise KvsimError(f"output: expected {G} rows (heads), got {outputs.shape[0]}")
        if "values" in self._needs and outputs.shape[1] != self._values.shape[1]:
            raise KvsimError(f"output: expected {self._values.shape[1]} columns (the values' "
                             f"dimension), got {outputs.shape[1]}")
        self._steps.observe(self._state, self._cache, n, self._obs, self._mass, outputs)
        self._observed = True


def _prompt_field(A: np.ndarray, H_kv: int):
    """The dense field a stepper's prefill reads: the (H, P, P) prompt rows ``A`` (one key
    when P = 0, so that the field is not empty; the prompt has no row to read)."""
    P = A.shape[1]
    probs = np.ascontiguousarray(A, dtype=np.float64) if P > 0 else np.ones((A.shape[0], 1, 1))
    return dense_field(probs, kv_heads=H_kv)


def _check_run(spec, policy: str, resolved: dict, budget, capacity_T, P: int) -> None:
    """A stepper's sizes and run check at its budget (:func:`run_problems`, stepping)."""
    if isinstance(capacity_T, bool) or not isinstance(capacity_T, (int, np.integer)) \
            or capacity_T < P:
        raise KvsimError(f"capacity_T: expected an integer >= P = {P}, got {capacity_T!r}")
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)):
        raise KvsimError(f"budget: expected an integer, got {budget!r}")
    for problem in run_problems(spec, resolved, [int(budget)], int(capacity_T), P,
                                stepping=True):
        raise KvsimError(problem.message, "budget" if problem.kind == "budget"
                         else f"{policy}.{problem.key}")


class UniformLayer:
    """One cache for several KV heads of a layer, ranked by the sum of their scores, one
    token at a time, as :func:`kvsim.protocols.uniform.run_uniform` simulates it:
    ``heads = "uniform"`` (every KV head of the layer), per token or in pages
    (``page``); or ``page`` alone, a layer of one KV head (``kv_heads = [j]``), as
    :func:`kvsim.protocols.pages.paged` simulates it.

    Each KV head is a :class:`Stepper` of the per-head rule that learns from its own query
    heads' attention through the one cache, started with every prompt key scored (the recent
    count of ``budget``). Per token: the prefill keeps the ``recent`` newest prompt keys and
    the best others by the summed prefill scores, and a token that would exceed ``budget``
    first removes the lowest-ranked unprotected key from every KV head. In pages of ``S``:
    the prefill keeps ``floor(budget / S)`` pages, and a token that opens a page when they
    are all held first removes the lowest-ranked page. :meth:`head` gives KV head ``j``'s
    view for a decoder (:class:`LayerView`): the first view to admit token ``t`` admits it
    in every KV head.

    Parameters are :class:`Stepper`'s, with ``prompt_attention`` the layer's (H_kv, G, P,
    P) and, per KV head ``j``, ``keys[j]``, ``values[j]``, ``queries[j]``, ``seeds[j]`` and
    ``rope[j]`` (lists over the layer's KV heads; None where the policy reads none);
    ``kv_heads``: the KV heads that share the cache (default: all).
    """

    def __init__(self, policy: str, budget: int, params: dict | None = None, *,
                 prompt_attention: np.ndarray, capacity_T: int, keys: list | None = None,
                 values: list | None = None, queries: list | None = None, scaling=None,
                 gqa: str = "mean", seeds: list | None = None, rope: list | None = None,
                 passes: dict | None = None, kv_heads: list[int] | None = None):
        spec = get_policy(policy)
        resolved = resolve_params(spec, params or {})
        A = _array("prompt_attention", prompt_attention, 4)
        H_kv, P = A.shape[0], A.shape[2]
        kv_heads = list(range(H_kv)) if kv_heads is None else [int(j) for j in kv_heads]
        uniform = resolved.get("heads") == "uniform"
        if not (uniform and len(kv_heads) == H_kv
                or not uniform and resolved.get("page", 1) != 1 and len(kv_heads) == 1):
            raise KvsimError(f"{policy}.heads: expected \"uniform\" for every KV head of the "
                             f"layer stepped as one cache, or pages for one KV head's, got "
                             f"{resolved.get('heads', 'per_head')!r}, page = "
                             f"{resolved.get('page', 1)} for KV heads {kv_heads} of {H_kv}")
        _check_run(spec, policy, resolved, budget, capacity_T, P)
        own = {**resolved, "heads": "per_head", "page": 1}
        first = max(P, 1, spec.min_budget(own))  # every prompt key scored: none evicted

        def each(x, j):
            return None if x is None else x[j]

        self._members = [Stepper(policy, first, own, prompt_attention=A, kv_head=j,
                                 keys=each(keys, j), values=each(values, j),
                                 queries=each(queries, j), scaling=scaling, gqa=gqa,
                                 seed=0 if seeds is None else seeds[j],
                                 capacity_T=capacity_T, rope=each(rope, j), passes=passes)
                         for j in kv_heads]
        self._view = {j: i for i, j in enumerate(kv_heads)}
        layout = spec.layout
        for m in self._members:
            if layout.recent is not None:  # the recent count of the budget, not of first
                m._state = m._state._replace(recent=layout.recent(int(budget), resolved))
            m.widen(capacity_T - P)  # room for every later key: only the layer evicts
        self._spec, self._slots = spec, layout.slot_fields(own)
        self._budget, self._extra = int(budget), [0] * len(kv_heads)
        self._page, self._reduce = resolved.get("page", 1), resolved.get("page_reduce")
        self._layer = self._runs()
        if self._page != 1:
            page_prefill(self._layer, P, self._page, self._reduce, self._budget, 0)
        else:
            layer_prefill(self._layer, P, self._budget,
                          layout.recent_count(int(budget), resolved))
        self._sync()
        self._first = self._next = P

    def _runs(self) -> LayerRun:
        """The KV heads' caches and states as the simulator's runs, ranked together."""
        runs = [Run(self._spec, m._state, m._cache, m._n, self._slots) for m in self._members]
        return LayerRun(runs, [m._prompt for m in self._members], [None] * len(runs), 0)

    def _sync(self) -> None:
        """Each KV head's stepper takes the cache size its run now has."""
        for m, run in zip(self._members, self._layer.runs):
            m._n = run.n

    @property
    def capacity(self) -> int:
        """The budget, widened by the most any view asked for (a task's question)."""
        return self._budget + max(self._extra)

    def head(self, j: int) -> "LayerView":
        """KV head ``j``'s view."""
        return LayerView(self, j)

    def cache_of(self, j: int) -> np.ndarray:
        """The layer's cached positions, in KV head ``j``'s slot order."""
        return self._members[self._view[j]].cache

    def admit(self, t: int) -> None:
        """Token ``t`` joins every KV head (once, whichever view asks first), room made
        first for the layer."""
        if t == self._next - 1 and self._next > self._first:  # another view admitted it
            return
        if t != self._next:
            raise KvsimError(f"admit: expected token {self._next} (tokens join in order), "
                             f"got {t!r}")
        for run, m in zip(self._layer.runs, self._members):
            run.n = m._n
        if self._page != 1:
            if t % self._page == 0:  # t opens a page
                page_evict(self._layer, t, self._page, self._reduce, self.capacity, 0)
                self._sync()
        elif self._layer.n + 1 > self.capacity:
            self._layer.compress(self.capacity - 1, t, 0)
            self._sync()
        for m in self._members:
            m.admit(t)
        self._next = t + 1

    def observe(self, j: int, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """KV head ``j``'s query heads attended over the cache (:meth:`Stepper.observe`)."""
        self._members[self._view[j]].observe(attention, output)

    def widen(self, j: int, extra: int) -> None:
        """``extra`` more keys, asked by KV head ``j``'s view (the layer takes the most any
        asked)."""
        self._extra[self._view[j]] += extra


class BlockLayer:
    """A rule that decides once for every KV head of a layer in whole blocks
    (``Policy.layer_cache``: ``openvino``, ``openvino_arkv``), one token at a time: the
    layer's one cache of :func:`kvsim.policies.openvino.simulate`, room made before a token
    joins, the KV heads' observed rows (each query head's over its mass, summed over the
    query heads, then over the KV heads in order) registered once every KV head has
    observed. :meth:`head` gives KV head ``j``'s view for a decoder (:class:`LayerView`).

    Parameters are :class:`Stepper`'s, with ``prompt_attention`` the layer's (H_kv, G, P,
    P) and ``keys`` a list of each KV head's (capacity_T, d) keys, by reference (for rules
    that read them).
    """

    def __init__(self, policy: str, budget: int, params: dict | None = None, *,
                 prompt_attention: np.ndarray, capacity_T: int, keys: list | None = None,
                 gqa: str = "mean", passes: dict | None = None):
        spec = get_policy(policy)
        if spec.layer_cache is None:
            raise KvsimError(f"{policy}: expected a rule with one cache per layer "
                             f"(Policy.layer_cache); step it with Stepper or UniformLayer")
        resolved = resolve_params(spec, params or {})
        A = _array("prompt_attention", prompt_attention, 4)
        H_kv, G, P = A.shape[0], A.shape[1], A.shape[2]
        _check_run(spec, policy, resolved, budget, capacity_T, P)
        if gqa not in GQA_MODES:
            raise KvsimError(f"gqa: expected one of {', '.join(GQA_MODES)}, got {gqa!r}")
        if keys is None and "keys" in spec.needs:
            raise KvsimError(f"keys: {policy} needs the keys of every KV head, got none")
        by_dim = [np.zeros((0, 0), np.float32)] * H_kv if keys is None else \
            [Stepper._vectors("keys", k, capacity_T, policy, True).T for k in keys]
        group = make_group(_prompt_field(A.reshape(H_kv * G, P, P), H_kv), 0, P,
                           np.zeros((H_kv * G, max(P, 1)), bool),
                           {} if passes is None else passes, GQA_MODES[gqa])
        self._cache = spec.layer_cache(group, int(budget), resolved, by_dim, int(capacity_T))
        self._extra = [0] * H_kv
        self._rows = np.zeros((H_kv, int(capacity_T)))
        self._seen = np.ones(H_kv, bool)  # which KV heads observed the newest token
        self._next, self._capacity = P, int(capacity_T)

    def head(self, j: int) -> "LayerView":
        """KV head ``j``'s view."""
        return LayerView(self, j)

    def cache_of(self, j: int) -> np.ndarray:
        """The layer's cached positions, in slot order (every KV head's)."""
        return self._cache.cache[:self._cache.n].copy()

    def admit(self, t: int) -> None:
        """Token ``t`` joins the layer (once, whichever view asks first), the blocks the
        rule frees leaving first."""
        if t == self._next - 1 and not self._seen.all():  # another view admitted it
            return
        if t != self._next or t >= self._capacity:
            raise KvsimError(f"admit: expected token {self._next} (tokens join in order, "
                             f"below capacity_T = {self._capacity}), got {t!r}")
        if not self._seen.all():
            raise KvsimError(f"admit: token {t - 1} was not observed by every KV head")
        self._cache.extra = max(self._extra)
        self._cache.make_room(self._cache.n + 1)
        self._cache.append(t)
        self._seen[:] = False
        self._next = t + 1

    def observe(self, j: int, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """KV head ``j``'s query heads attended over the cache: ``attention`` (G, n), each
        row taken over its own sum; the layer registers the sum once all have."""
        n = self._cache.n
        a = _array("attention", attention, 2)
        if self._seen[j] or a.shape[1] != n:
            raise KvsimError(f"observe: expected KV head {j}'s attention over the {n} cached "
                             f"keys once per token, got {a.shape} "
                             f"{'again' if self._seen[j] else ''}".rstrip())
        self._cache.head_row(a, self._rows[j])
        self._seen[j] = True
        if self._seen.all():
            total = np.zeros(n)
            for k in range(self._rows.shape[0]):
                total += self._rows[k, :n]
            self._cache.register(total)

    def widen(self, j: int, extra: int) -> None:
        """``extra`` more keys, asked by KV head ``j``'s view (the layer takes the most any
        asked): they join the rule's arena (``A + extra``), without eviction."""
        self._extra[j] += extra


class LayerView:
    """KV head ``j`` of a :class:`UniformLayer` or :class:`BlockLayer`, as a decoder
    steps it (:class:`Stepper`'s ``cache``, ``admit``, ``observe``, ``widen``)."""

    def __init__(self, layer: UniformLayer | BlockLayer, j: int):
        self._layer, self._j = layer, j

    @property
    def cache(self) -> np.ndarray:
        """The layer's cached positions, in this KV head's slot order."""
        return self._layer.cache_of(self._j)

    def admit(self, t: int) -> int:
        """Token ``t`` joins the layer; returns -1 (an eviction is the layer's)."""
        self._layer.admit(t)
        return -1

    def observe(self, attention: np.ndarray, output: np.ndarray | None = None) -> None:
        """This KV head's query heads attended over the cache."""
        self._layer.observe(self._j, attention, output)

    def widen(self, extra: int) -> None:
        """``extra`` more keys for the layer (:meth:`UniformLayer.widen`)."""
        self._layer.widen(self._j, extra)
