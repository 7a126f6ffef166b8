"""What a policy is: its parameters, its budget floor, its step code, and how it runs on
one KV head."""

from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, NamedTuple

import numpy as np

from kvsim.errors import Problem
from kvsim.numerics import kernels
from kvsim.numerics.decode import Context, Outputs
from kvsim.numerics.field import FieldData
from kvsim.numerics.fullpass import FullPass, full_pass
from kvsim.params import Param
from kvsim.policies import ring
from kvsim.policies.layout import StateLayout


@dataclass(frozen=True)
class Group:
    """Everything a policy may read about one KV head and the query heads sharing it.

    ``important`` is a (G, T) boolean mask of ground-truth positions per query head. Full
    passes are computed on first use and memoised in ``memo`` (shared by the groups of one
    sequence), keyed by (head, prompt length, rows): a component field needs every row
    (its row statistics), a dense field only what a policy asks for.
    """

    field: FieldData
    heads: np.ndarray
    prompt_len: int
    memo: dict
    important: np.ndarray
    gqa: int = kernels.GQA_MEAN
    seed: int = 0
    snap_budget: int = -1  # the budget whose cache is recorded at ``snap_steps``
    snap_steps: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    vectors: tuple = ()  # (keys (d, T), values (T, dv)[, queries (G, T, d), scales (G,)])
    progress: bool = False  # long full passes show their rows on stderr
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False, repr=False)

    @property
    def T(self) -> int:
        return self.field.T

    @property
    def row_max(self) -> np.ndarray:
        """(H, T) row maxima, filled for this group's heads."""
        return self._stats()[0]

    @property
    def row_sum(self) -> np.ndarray:
        return self._stats()[1]

    @property
    def keys(self) -> np.ndarray:
        """(d, T) the KV head's key vectors by dimension ((0, 0) if the source has none)."""
        return self.vectors[0] if self.vectors else self.field.keys[self.kv_head]

    @property
    def values(self) -> np.ndarray:
        """(T, dv) the KV head's value vectors ((0, 0) if the source has none)."""
        return self.vectors[1] if self.vectors else self.field.values[self.kv_head]

    @property
    def queries(self) -> np.ndarray:
        """(G, T, d) the group's query vectors ((G, 0, 0) if the source has none)."""
        return self.vectors[2] if len(self.vectors) > 2 else self.field.queries[self.heads]

    @property
    def qk_scale(self) -> np.ndarray:
        """(G,) float64: each query head's logit is ``qk_scale * q . k``."""
        return self.vectors[3] if len(self.vectors) > 3 else self.field.qk_scale[self.heads]

    @property
    def kv_head(self) -> int:
        return int(self.heads[0]) // self.field.group

    def layer_groups(self) -> list[Group]:
        """The groups of every KV head of this group's layer (its field), in KV-head order,
        sharing the full-pass memo: for rules that choose one set for a whole layer."""
        G = self.field.group
        return [self if kv == self.kv_head else dataclasses.replace(
            self, heads=np.arange(kv * G, (kv + 1) * G, dtype=np.int64),
            important=np.zeros((G, self.T), bool), vectors=(), _cache={},
            _lock=threading.Lock()) for kv in range(self.field.heads // G)]

    def shared(self, key: tuple, compute: Callable[[], object]):
        """A value derived from this KV head's prompt and GQA mode alone (not from the
        budget), computed once for every group sharing the memo (each policy and budget of
        the head): ``compute()`` the first time ``key`` is asked for."""
        full = ("shared", self.kv_head, self.prompt_len, self.gqa, *key)
        if full not in self.memo:
            self.memo.setdefault(full, compute())
        return self.memo[full]

    def passes(self, rows: int | None = None) -> tuple[FullPass, ...]:
        """The full pass of every query head of the group over queries ``0 .. rows-1``."""
        rows = self.T if rows is None or not self.field.is_dense else rows
        with self._lock:  # one parallel full pass at a time, whatever thread asks
            for h in self.heads:
                key = (int(h), self.prompt_len, rows)
                if key not in self.memo:
                    self.memo[key] = full_pass(self.field, int(h), self.prompt_len, rows,
                                               self.progress)
            return tuple(self.memo[int(h), self.prompt_len, rows] for h in self.heads)

    @property
    def full_output(self) -> np.ndarray:
        """(G, steps, dv) full-attention outputs ``o(t)`` (dv = 0 without values)."""
        if not self.field.has_values(int(self.heads[0]) // self.field.group):
            return np.zeros((len(self.heads), self.T - self.prompt_len, 0))
        if "full_output" not in self._cache:  # every policy and budget reads it
            stacked = np.stack([p.full_output for p in self.passes()])
            with self._lock:
                self._cache.setdefault("full_output", stacked)
        return self._cache["full_output"]

    def _stats(self) -> tuple[np.ndarray, np.ndarray]:
        if "stats" not in self._cache:
            row_max = np.zeros((self.field.heads, self.T))
            row_sum = np.ones((self.field.heads, self.T))
            if not self.field.is_dense:  # dense probabilities need no row statistics
                for h, p in zip(self.heads, self.passes()):
                    row_max[h], row_sum[h] = p.row_max, p.row_sum
            with self._lock:
                self._cache.setdefault("stats", (row_max, row_sum))
        return self._cache["stats"]

    def combine(self, per_head: list[np.ndarray]) -> np.ndarray:
        """Combine one score array per query head (mean, max or sum) with the kernels' own
        :func:`kvsim.numerics.kernels.combine_rows`, so prefill and per-step scores agree bit for bit."""
        stacked = np.ascontiguousarray(np.stack(per_head), dtype=np.float64)
        out = np.empty(stacked.shape[1])
        kernels.combine_rows(stacked, stacked.shape[1], self.gqa, out)
        return out

    def prompt_scores(self) -> np.ndarray:
        """Column sums of the prompt rows, combined over the group."""
        return self.combine([p.prompt_colsum for p in self.passes(self.prompt_len)])

    def global_scores(self) -> np.ndarray:
        """Column sums of all rows (future queries included), combined over the group."""
        return self.combine([p.prompt_colsum + p.decode_colsum for p in self.passes()])

    def row_scores(self, lo: int, hi: int) -> np.ndarray:
        """Attention summed over queries ``lo .. hi-1``, combined over the group."""
        key = ("rows", lo, hi)
        row_max, row_sum = self._stats()
        with self._lock:  # policies of one group may run on several threads
            if key not in self._cache:
                self._cache[key] = self.combine([
                    kernels.row_sums(self.field, row_max, row_sum, h, lo, hi)
                    for h in self.heads])
            return self._cache[key]


@dataclass
class Trace:
    """Per-step series (one row per query head of the group) and final cache."""

    mass: np.ndarray        # (G, steps)
    cache_size: np.ndarray  # (steps,)
    recall: np.ndarray      # (G, steps)
    error: np.ndarray       # (G, steps): relative output error, NaN without values
    kept: np.ndarray
    snapshots: np.ndarray   # (len(snap_steps), budget) cached positions, -1 padded, or (0, 0)


NEEDS = frozenset({"keys", "values", "queries", "rope"})
"""What a policy may need from its source besides attention (``Policy.needs``); ``rope``:
the queries before RoPE and the RoPE settings (``FieldData.pre_rope_queries``,
``rope_freq``, ``rope_scale``)."""


class Plain(NamedTuple):
    """A policy's loop of a plain run (:attr:`Steps.plain`): ``loop``, taking the states
    for which ``takes(state)`` holds."""

    loop: Callable
    takes: Callable[[NamedTuple], bool]


@dataclass(frozen=True)
class Steps:
    """A policy's step code (:mod:`kvsim.numerics.decode` defines the protocol).

    ``start(prompt, budget, params, T) -> (kept, state)``: the prefill selection (cached
    positions in slot order) and the decode state, sized for positions ``< T``; ``prompt``
    is a :class:`Group` of which only the prompt rows are read (the
    :class:`~kvsim.protocols.stepping.Stepper` builds one from a prompt's attention).
    ``admit``/``observe``: the compiled steps; ``decode``: the policy's compiled loop,
    ``decode_kernel("decode", admit, observe)``. ``prepare(state, group,
    params, t)``, where given, runs before ``admit`` of token ``t`` one step at a time
    (the simulator's ``start`` has done its work for every position already).
    ``rank(state, cache, n, t, seed) -> (value (n,), protected (n,) bool)``, where given,
    scores the cached keys as a compression before token ``t`` joins ranks them once
    (``t < 0``: the prefill's judgement of the prompt keys, nothing incoming;
    :mod:`kvsim.protocols.dispatch`); pages and thresholds need it.
    ``plain``, where given, is the loop of a plain run (one query head of a dense matrix,
    no values, no snapshots) and the states it takes (:class:`Plain`): the same numbers as
    ``decode``, from :func:`kvsim.numerics.decode.decode_kernel` with ``plain=True``, a
    kernel of its own so that only plain runs compile it.
    """

    start: Callable[[Group, int, dict, int], tuple[np.ndarray, NamedTuple]]
    admit: Callable
    observe: Callable
    decode: Callable
    prepare: Callable[[NamedTuple, Group, dict, int], None] | None = None
    rank: Callable | None = None
    plain: Plain | None = None


@dataclass(frozen=True)
class Presentation:
    """How a policy is shown: its row of the policy table (``kvsim policies --markdown``)
    and its colour and marker in every figure.

    ``family``: policies of one family share a hue (default: the policy's own name);
    ``rule``: the table's one-line rule (default: the summary); ``reads``: what it reads
    from its source, in words. ``color``/``marker``: declared ones; without them figures
    draw a shade of the family's hue and a marker of the policy's own
    (:mod:`kvsim.report.palette`).
    """

    family: str = ""
    rule: str = ""
    reads: str = "attention"
    color: str | None = None
    marker: str | None = None


@dataclass(frozen=True)
class Policy:
    """A registered policy.

    ``steps`` is its step code; ``run(group, budget, params)`` returns a :class:`Trace`
    (by default the decode loop over ``steps``); ``run_budgets(group, budgets, params)``,
    where given, returns one per budget from work shared across budgets.
    ``min_budget(params)`` is the smallest valid budget (fixed parts + 1);
    ``check(T, prompt_len, params)`` returns a cross-field :class:`~kvsim.errors.Problem`
    (the parameter, what was expected) or None. ``needs`` names what the policy reads from
    its source besides attention (a subset of :data:`NEEDS`); ``closed_loop(params)`` says
    why it cannot run one step at a time on attention from elsewhere, or None. ``layer``:
    its prefill chooses one set for the whole layer from every KV head's attention
    (:meth:`Group.layer_groups`), so a :class:`~kvsim.protocols.stepping.Stepper` of it
    takes the layer's attention (its ``kv_head``). ``layer_cache(group, budget, params,
    keys, capacity)``: for a rule that decides once for every KV head of a layer
    (``openvino``), the layer's one cache of room ``capacity``, built from the layer's
    prompt (``group``) and each KV head's ``(d, T)`` ``keys``, which
    :class:`~kvsim.protocols.stepping.BlockLayer` steps inside a model.

    For budget allocation (:mod:`kvsim.engine.allocation`): ``fixed(budget, prompt_len,
    params)`` counts the fixed parts at a budget (sinks, window, recent tokens);
    ``prefill_score(group, budget, params)``, for policies with a prefill score, gives the
    scores of the selectable prompt keys (positions ``0 .. n-1``) at that budget;
    ``run_capped(group, cap, budget, params)`` runs with capacity ``cap`` and the fixed
    parts of ``budget`` (default: ``run`` at ``cap``, for fixed parts that do not depend
    on the budget).

    ``rescore(group, cache, t, since, params)``, where given, scores the cached positions
    ``cache`` at a batched compression (``interval``, ``target_ratio``) before token ``t``
    joins, from the decode queries ``since .. t-1`` since the last compression (or, as
    ``rkv``, from the newest queries); None where it has nothing to re-score from (the
    per-step ranking then applies). A score of ``+inf`` keeps a key.

    ``saturation(T, params)``: the smallest budget at which the policy keeps every key of
    ``T`` tokens (a larger budget runs as this one; default ``T``).

    ``presentation``: its family, table row, colour and marker (:class:`Presentation`).
    ``layout`` declares what the protocols read of the step state and the fixed parts
    (:class:`~kvsim.policies.layout.StateLayout`); a policy with step code and no layout
    takes no protocol.
    """

    name: str
    summary: str
    params: dict[str, Param]
    steps: Steps | None = None
    _: KW_ONLY
    run: Callable[[Group, int, dict], Trace] | None = None
    min_budget: Callable[[dict], int] = lambda params: 1
    check: Callable[[int, int, dict], Problem | None] = lambda T, prompt_len, params: None
    budgeted: bool = True
    run_budgets: Callable[[Group, list[int], dict], list[Trace]] | None = None
    needs: frozenset[str] = frozenset()
    closed_loop: Callable[[dict], str | None] = lambda params: None
    layer: bool = False
    layer_cache: Callable[[Group, int, dict, list, int], object] | None = None
    floor_reason: str = "its fixed parts + 1"  # why min_budget can exceed 1, for errors
    fixed: Callable[[int, int, dict], int] = lambda budget, prompt_len, params: 0
    prefill_score: Callable[[Group, int, dict], np.ndarray] | None = None
    run_capped: Callable[[Group, int, int, dict], Trace] | None = None
    rescore: Callable[[Group, np.ndarray, int, int, dict], np.ndarray | None] | None = None
    presentation: Presentation = Presentation()
    layout: StateLayout | None = None  # what protocols read (kvsim.policies.layout)
    saturation: Callable[[int, dict], int] = lambda T, params: T

    def __post_init__(self):
        if not self.needs <= NEEDS:
            raise ValueError(f"{self.name}: needs {set(self.needs - NEEDS)}, not in {set(NEEDS)}")
        if self.run is None:
            if self.steps is None:
                raise ValueError(f"{self.name}: expected step code or a run function")
            object.__setattr__(self, "run", functools.partial(run_steps, self.steps))
        shown = self.presentation
        object.__setattr__(self, "presentation", dataclasses.replace(
            shown, family=shown.family or self.name, rule=shown.rule or self.summary))

    def run_all(self, group: Group, budgets: list[int], params: dict) -> list[Trace]:
        """One trace per budget (shared work where the policy supports it)."""
        if self.run_budgets is not None:
            return self.run_budgets(group, budgets, params)
        return [self.run(group, b, params) for b in budgets]

    def run_cap(self, group: Group, cap: int, budget: int, params: dict) -> Trace:
        """One trace with at most ``cap`` cached keys and the fixed parts of ``budget``."""
        if self.run_capped is not None:
            return self.run_capped(group, cap, budget, params)
        return self.run(group, cap, params)


def current(value: np.ndarray, cache: np.ndarray, n: int, t: int,
            recent: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A ``Steps.rank`` answer: the scores ``value[:n]`` of the cached keys and which are
    protected, the ``recent`` newest positions ``t - recent + 1 .. t`` (none when ``t < 0``,
    the prefill's judgement of every prompt key)."""
    protected = cache[:n] > t - recent if t >= 0 else np.zeros(n, bool)
    return np.array(value[:n], np.float64), protected


def new_trace(group: Group) -> Trace:
    """Empty per-step outputs for the decode steps of ``group``."""
    G, steps = len(group.heads), group.T - group.prompt_len
    kv = int(group.heads[0]) // group.field.group
    error = np.zeros((G, steps)) if group.field.has_values(kv) else np.full((G, steps), np.nan)
    return Trace(np.zeros((G, steps)), np.zeros(steps, np.int64), np.zeros((G, steps)), error,
                 np.empty(0, np.int64), np.zeros((0, 0), np.int64))


def snapshot_steps(group: Group, budget: int) -> np.ndarray:
    """The decode steps at which this run records its cache (none unless asked)."""
    return group.snap_steps if budget == group.snap_budget else np.zeros(0, np.int64)


def context(group: Group, start: int | None = None, stop: int | None = None) -> Context:
    """The decode loop's view of ``group``, over tokens ``start .. stop-1`` (default: every
    decode step)."""
    P = group.prompt_len
    return Context(group.field, group.row_max, group.row_sum, group.heads, P,
                   group.important, group.full_output, P if start is None else start,
                   group.T if stop is None else stop)


def run_decode(group: Group, capacity: int, kept: np.ndarray, decode: Callable | None = None,
               state: NamedTuple | None = None) -> Trace:
    """Run a policy's compiled decode loop ``decode`` with ``state`` from the prefill
    selection ``kept`` (slot order) with ``capacity`` slots.

    Without ``decode``: the window rule (a ring over every slot, oldest key first).
    """
    if decode is None:
        decode, state = ring.decode, ring.Ring(0, group.prompt_len - len(kept), capacity)
    n = kept.shape[0]
    cache = np.zeros(capacity, np.int64)
    cache[:n] = kept
    trace = new_trace(group)
    snap_steps = snapshot_steps(group, capacity)
    trace.snapshots = np.full((snap_steps.shape[0], capacity), -1, np.int64)
    out = Outputs(trace.mass, trace.cache_size, trace.recall, trace.error, snap_steps,
                  trace.snapshots)
    n = decode(context(group), out, cache, n, state)
    trace.kept = np.sort(cache[:n])
    return trace


def run_steps(steps: Steps, group: Group, budget: int, params: dict) -> Trace:
    """A policy's trace from its step code: prefill selection, then the decode loop (that
    of a plain run where the policy has one)."""
    kept, state = steps.start(group, budget, params, group.T)
    decode = steps.decode
    if steps.plain is not None and steps.plain.takes(state) and is_plain(group, budget):
        decode = steps.plain.loop
    return run_decode(group, budget, kept, decode, state)


def is_plain(group: Group, capacity: int) -> bool:
    """Whether a run at ``capacity`` is plain: one query head of a dense matrix, no
    values, no snapshots (:func:`kvsim.numerics.decode.is_plain`)."""
    return (group.field.is_dense and len(group.heads) == 1
            and not group.field.has_values(group.kv_head)
            and snapshot_steps(group, capacity).shape[0] == 0)
