"""Attention objects: the input of :func:`kvsim.simulate`, checked once and reused."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from kvsim.api import arguments
from kvsim.attention.dense import DTYPES, probability_stack, softmax_logits
from kvsim.attention.sources import Field
from kvsim.attention.trace import layer_field
from kvsim.engine.cost import check as check_cost
from kvsim.errors import KvsimError, ScenarioError
from kvsim.numerics.field import dense_field
from kvsim.numerics.kernels import GQA_MODES
from kvsim.scenario.load import Scenario, validate

SEEDED_SOURCES = ("field", "seed_notebook")  # sources whose random terms depend on the seed


class Attention:
    """Causal attention of ``heads`` query heads over ``T`` positions, ready to simulate.

    Build one with a ``from_*`` constructor; its input is checked once, so every later
    :func:`kvsim.simulate` call on it pays no check, and full-attention passes computed
    for one call are kept for the next. A dense float64 C-contiguous matrix is used
    in place, never copied.

    Attributes
    ----------
    T : int
        Sequence length.
    heads, kv_heads : int
        Query heads and KV heads (``heads // kv_heads`` query heads share a cache).
    gqa : str
        How a KV head's query heads combine scores: ``"mean"``, ``"max"`` or ``"sum"``.
    kind : str
        ``"probabilities"``, ``"logits"``, ``"qk"`` or the scenario source name.
    has_truth : bool
        Whether ground-truth important positions are known (for recall).
    """

    def __init__(self, kind: str, T: int, heads: int, kv_heads: int, gqa: str, has_truth: bool,
                 field: Field | None = None, scenario: Scenario | None = None):
        self.kind, self.T, self.heads, self.kv_heads = kind, T, heads, kv_heads
        self.gqa, self.has_truth = gqa, has_truth
        self._field, self._scenario = field, scenario
        self._fields: dict[int, Field] = {}
        self._passes: dict[int, dict] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (f"Attention(kind={self.kind!r}, T={self.T}, heads={self.heads}, "
                f"kv_heads={self.kv_heads}, gqa={self.gqa!r}, has_truth={self.has_truth})")

    @property
    def seeded(self) -> bool:
        """Whether each seed draws a different field (a spec with random terms)."""
        return self._scenario is not None

    def field(self, seed: int = 0) -> Field:
        """The field's arrays and ground truth for sequence ``seed``."""
        if self._field is not None:
            return self._field
        with self._lock:
            if seed not in self._fields:
                self._fields[seed] = self._scenario.field(seed)
            return self._fields[seed]

    def passes(self, seed: int = 0) -> dict:
        """The memo of full passes of sequence ``seed``, shared by every call."""
        key = seed if self.seeded else 0
        with self._lock:
            return self._passes.setdefault(key, {})

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_probs(cls, probs, *, kv_heads: int | None = None, important=None,
                   gqa: str = "mean", check: bool = True) -> Attention:
        """Attention from causal probabilities.

        Parameters
        ----------
        probs : array_like, (T, T) or (H, T, T), float16, float32 or float64
            Row ``q`` holds ``p(q, k)`` for ``k <= q`` and zeros above the diagonal.
        kv_heads : int, optional
            KV heads of a grouped-query layout (must divide H; default H).
        important : array_like of int, optional
            Ground-truth important positions (shared by every head), for recall.
        gqa : {"mean", "max", "sum"}
            How the query heads of a KV head combine their scores.
        check : bool
            Check every entry (finite, non-negative, causal, rows summing to 1 within the
            dtype's tolerance) in one pass. ``False`` trusts the input, like
            ``scipy.linalg``'s ``check_finite=False``: invalid data then gives undefined
            results or an ``InvariantError``.

        Returns
        -------
        Attention
            Holding a float64 copy of ``probs`` (renormalised where rows are off by more
            than 1e-12), so that changes to ``probs`` afterwards do not reach it.
        """
        check = arguments.flag(check, "check")
        given = arguments.array(probs, "probs")
        stack = probability_stack(given, "probs", check)
        if np.may_share_memory(stack, given):
            stack = stack.copy()  # the Attention owns its data: later writes cannot fool it
        return cls._dense("probabilities", stack, kv_heads, important, gqa)

    @classmethod
    def from_logits(cls, logits, *, kv_heads: int | None = None, important=None,
                    gqa: str = "mean") -> Attention:
        """Attention from causal logits, (T, T) or (H, T, T) in float16, 32 or 64.

        Entries above the diagonal are ignored; ``-inf`` masks a key below it. The
        causal softmax is computed once, in float64. Other parameters as
        :meth:`from_probs`.
        """
        a = arguments.array(logits, "logits")
        if a.ndim not in (2, 3):
            raise KvsimError(f"logits: expected a (T, T) or (H, T, T) matrix, got shape {a.shape}")
        stack = a[None] if a.ndim == 2 else a
        probs = np.stack([softmax_logits(m, "logits" if a.ndim == 2 else f"logits: head {h}")
                          for h, m in enumerate(stack)])
        return cls._dense("logits", probs, kv_heads, important, gqa)

    @classmethod
    def _dense(cls, kind: str, stack: np.ndarray, kv_heads, important, gqa: str) -> Attention:
        H, T = stack.shape[0], stack.shape[1]
        kv = _kv_heads(kv_heads, H)
        mask = arguments.important(important, T, H)
        return cls(kind, T, H, kv, _gqa(gqa), mask is not None,
                   field=Field(dense_field(stack, kv), mask))

    @classmethod
    def from_qk(cls, queries, keys, values=None, *, scaling: float | None = None,
                important=None, gqa: str = "mean", check: bool = True) -> Attention:
        """Attention from query and key vectors (and values, for the output error).

        Parameters
        ----------
        queries : array_like, (H, T, d)
        keys : array_like, (H_kv, T, d)
            Query head ``h`` reads KV head ``h // (H // H_kv)`` (grouped-query layout).
        values : array_like, (H_kv, T, dv), optional
        scaling : float, optional
            Logits are ``q . k * scaling`` (default ``1 / sqrt(d)``), causal.
        important, gqa : as :meth:`from_probs`.
        check : bool
            Check that every vector entry is finite.

        Notes
        -----
        Vectors are held as float32 (as a trace's are); logits are summed in float64.
        """
        check = arguments.flag(check, "check")
        q, k = _vectors(queries, "queries"), _vectors(keys, "keys")
        v = None if values is None else _vectors(values, "values")
        H, T, d = q.shape
        if k.shape[1:] != (T, d) or k.shape[0] < 1 or H % k.shape[0]:
            raise KvsimError(f"keys: expected shape (H_kv, {T}, {d}) with H_kv dividing {H}, "
                             f"got {k.shape}")
        if v is not None and v.shape[:2] != k.shape[:2]:
            raise KvsimError(f"values: expected shape ({k.shape[0]}, {T}, dv), got {v.shape}")
        if T < 1 or d < 1:
            raise KvsimError(f"queries: expected T >= 1 and d >= 1, got shape {q.shape}")
        if check:
            for name, a in (("queries", q), ("keys", k), ("values", v)):
                if a is not None and not np.isfinite(a).all():
                    raise KvsimError(f"{name}: expected finite values")
        if scaling is None:
            scale = 1.0 / np.sqrt(d)
        elif isinstance(scaling, (bool, np.bool_)) or not isinstance(
                scaling, (int, float, np.integer, np.floating)) \
                or not 0.0 < float(scaling) < np.inf:
            raise KvsimError(f"scaling: expected a positive finite number, got {scaling!r}")
        else:
            scale = float(scaling)
        mask = arguments.important(important, T, H)
        return cls("qk", T, H, k.shape[0], _gqa(gqa), mask is not None,
                   field=Field(layer_field(q, k, v, scale), mask))

    @classmethod
    def from_spec(cls, spec: dict, base: str | Path = ".") -> Attention:
        """Attention from a dict shaped like a scenario's ``[attention]`` table.

        ``spec["source"]`` defaults to ``"field"`` (a composed field: sinks, recency, heavy
        hitters, boosts, noise, qk); ``"trace"``, ``"matrix"`` and ``"seed_notebook"``
        take their TOML keys too. Paths are relative to ``base``. A source with random
        terms draws one field per seed of :func:`kvsim.simulate`.

        Examples
        --------
        >>> att = kvsim.Attention.from_spec({"T": 2048, "heads": 2,
        ...                                  "sinks": {"count": 4, "strength": 6.0},
        ...                                  "recency": {"kind": "power", "alpha": 0.8}})
        """
        if not isinstance(spec, dict):
            raise KvsimError(f"spec: expected a dict shaped like the [attention] table, "
                             f"got {type(spec).__name__}")
        doc = {"name": "api", "attention": {"source": "field", **spec},
               "policies": {"full": {}}, "experiment": [{"budgets": [1]}]}
        try:
            scenario = validate(doc, Path(base) / "spec")
            check_cost([scenario], workers=1)  # the CLI's refusal: one sequence must fit
        except ScenarioError as exc:
            raise KvsimError("; ".join(
                f"spec.{k.removeprefix('attention.')}: {m}" if k else m
                for _, k, m in exc.problems)) from None
        seeded = scenario.source in SEEDED_SOURCES
        return cls(scenario.source, scenario.T, scenario.heads, scenario.kv_heads, scenario.gqa,
                   scenario.has_truth, field=None if seeded else scenario.field(0),
                   scenario=scenario if seeded else None)

    @classmethod
    def from_trace(cls, path: str | Path, **params) -> Attention:
        """Attention replayed from a captured ``.npz`` trace (``python -m kvsim capture``).

        ``params`` are the trace source's keys: ``layer``, ``kv_head_ids``, ``T``, ``gqa``.
        """
        return cls.from_spec({"source": "trace", "path": str(path), **params})


def _gqa(gqa) -> str:
    if gqa not in GQA_MODES:
        raise KvsimError(f"gqa: expected one of {', '.join(GQA_MODES)}, got {gqa!r}")
    return gqa


def _kv_heads(kv_heads, heads: int) -> int:
    if kv_heads is None:
        return heads
    kv = arguments.integer(kv_heads, "kv_heads", 1, heads)
    if heads % kv:
        raise KvsimError(f"kv_heads: expected a divisor of the {heads} heads, got {kv}")
    return kv


def _vectors(a, name: str) -> np.ndarray:
    """A float32 copy of ``a`` that the Attention owns (a view could change under it)."""
    a = arguments.array(a, name)
    if a.ndim != 3:
        raise KvsimError(f"{name}: expected a 3-D array (heads, T, d), got shape {a.shape}")
    if a.dtype not in DTYPES:
        raise KvsimError(f"{name}: expected float16, float32 or float64, got dtype {a.dtype}")
    with np.errstate(over="ignore"):  # float64 beyond float32's range: inf, caught by check
        return np.array(a, dtype=np.float32, order="C")
