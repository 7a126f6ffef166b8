"""Attention sources a scenario can name in ``[attention] source = ...``.

A source turns its parameters and a seed into per-head float64 probability matrices
of shape (heads, T, T) plus optional ground-truth important positions.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from kvsim.attention import components, files, trace
from kvsim.attention.dense import probabilities, softmax_logits
from kvsim.attention.seed_notebook import planted_matrix
from kvsim.errors import KvsimError
from kvsim.numerics.field import FieldData, dense_field
from kvsim.params import Param


@dataclass(frozen=True)
class Field:
    """Attention of one sequence: the field's arrays and ground truth per query head.

    ``important`` is an (H, T) boolean mask, or None where the source has no ground truth.
    """

    data: FieldData
    important: np.ndarray | None

    @property
    def T(self) -> int:
        return self.data.T

    @property
    def mask(self) -> np.ndarray:
        """(H, T) ground-truth mask, all False without ground truth."""
        if self.important is None:
            return np.zeros((self.data.heads, self.T), bool)
        return self.important


def positions_mask(positions: np.ndarray | None, heads: int, T: int) -> np.ndarray | None:
    """(heads, T) mask with the same important positions for every head (range checked)."""
    if positions is None:
        return None
    positions = np.asarray(positions)
    if positions.size and (positions.min() < 0 or positions.max() >= T):
        raise KvsimError(f"expected positions in [0, {T}), "
                         f"got {positions.min()}..{positions.max()}", "important")
    mask = np.zeros((heads, T), bool)
    mask[:, positions] = True
    return mask


@dataclass(frozen=True)
class Source:
    """A registered attention source.

    ``describe(params, base)`` checks the parameters against the data and gives
    ``(T, query heads, KV heads, has ground truth)``, or raises :class:`KvsimError`;
    ``build(params, seed, base)`` returns a :class:`Field`, of the layer
    ``params["layer"]`` where the source has several; ``provides(params, base)`` names what
    it has besides attention (of "keys", "values", "queries", "rope": a policy's ``needs``)
    and ``note(params, base)`` the words that end an error for what it lacks (e.g. how to
    recapture an old trace); ``layers(params, base)`` lists the layers run jointly (after
    ``describe``).
    """

    name: str
    summary: str
    params: dict[str, Param]
    required: tuple[str, ...]
    describe: Callable[[dict, Path], tuple[int, int, int, bool]]
    build: Callable[[dict, int, Path], Field]
    provides: Callable[[dict, Path], frozenset] = lambda params, base: frozenset()
    layers: Callable[[dict, Path], tuple[int, ...]] = lambda params, base: (0,)
    note: Callable[[dict, Path], str] = lambda params, base: ""


def _notebook_describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    if params["important"] > params["T"]:
        raise KvsimError(f"expected at most T = {params['T']}, got {params['important']}",
                         "important")
    return params["T"], 1, 1, params["important"] > 0


def _notebook_build(params: dict, seed: int, base: Path) -> Field:
    A, important = planted_matrix(params["T"], params["important"], params["boost"],
                                  params["noise"], seed)
    return Field(dense_field(probabilities(A)[None]), positions_mask(important, 1, T=A.shape[0]))


SEED_NOTEBOOK = Source(
    "seed_notebook", "the seed notebook's planted matrix (uniform + boosted important keys + "
    "exponential noise)",
    {
        "T": Param(int, 512, "sequence length", low=1),
        "important": Param(int, 32, "number of planted important tokens", low=0),
        "boost": Param(float, 8.0, "weight added to important keys (base weight 1)",
                       low=0, high=1e6),
        "noise": Param(float, 0.1, "scale of the exponential noise", low=0, high=1e6),
    }, (), _notebook_describe, _notebook_build)


def _read_matrix(params: dict, base: Path) -> tuple[np.ndarray, np.ndarray | None]:
    path = Path(os.path.realpath(base / params["path"]))
    found = files.headers(path)
    if list(found) == [""]:
        name = ""
    else:
        names = [n for n in found if n != "important"]
        name = params["array"] or (names[0] if len(names) == 1 else "attention")
        if name not in found:
            raise KvsimError(f"expected one of {sorted(found)} in {path.name}, got {name!r}",
                             "array")
    arrays = files.load(path, [name, "important"], "the attention matrix")
    matrix = arrays[name]
    if matrix.ndim not in (2, 3) or 0 in matrix.shape:
        raise KvsimError(f"expected shape (T, T) or (heads, T, T) with T >= 1, got "
                         f"{matrix.shape}", "path")
    important = arrays.get("important")
    if params["important"]:
        important = np.asarray(params["important"], dtype=np.int64)
    elif important is not None and (important.ndim != 1 or (
            important.size and not np.issubdtype(important.dtype, np.integer))):
        raise KvsimError(f"expected the array 'important' to list integer positions, got "
                         f"shape {important.shape} of {important.dtype}", "path")
    return (matrix[None] if matrix.ndim == 2 else matrix), important


def _matrix_build(params: dict, seed: int, base: Path) -> Field:
    matrix, important = _read_matrix(params, base)
    convert = probabilities if params["kind"] == "probabilities" else softmax_logits
    try:
        probs = np.stack([convert(m, f"head {h}") for h, m in enumerate(matrix)])
    except KvsimError as exc:
        raise KvsimError(str(exc), "path") from None
    return Field(dense_field(probs), positions_mask(important, probs.shape[0], probs.shape[-1]))


def _matrix_describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    # Validation checks the whole matrix, so bad data never reaches a run.
    field = _matrix_build(params, 0, base)
    return field.T, field.data.heads, field.data.heads, field.important is not None


MATRIX = Source(
    "matrix", "a dense attention matrix from a .npy/.npz file (probabilities or logits)",
    {
        "path": Param(str, "", "file path, relative to the scenario file"),
        "kind": Param(str, "probabilities", "what the matrix holds",
                      choices=("probabilities", "logits")),
        "array": Param(str, "", "array name inside a .npz (default: its only array, "
                                "else 'attention')"),
        "important": Param(list, [], "ground-truth important positions (or an .npz array "
                                     "named 'important')",
                           check=lambda v: all(isinstance(x, int) and not isinstance(x, bool)
                                               and 0 <= x < 2**62 for x in v),
                           expect="a list of integer positions >= 0"),
    }, ("path",), _matrix_describe, _matrix_build)



FIELD_PARAMS = {
    "T": Param(int, 4096, "sequence length (prompt + decode)", low=1),
    "heads": Param(int, 1, "query heads", low=1, high=65536),
    "kv_heads": Param(int, None, "KV heads (default: heads); must divide heads", low=1,
                      high=65536),
    "gqa": Param(str, "mean", "how a group's query heads combine scores",
                 choices=("mean", "max", "sum")),
    "layers": Param(int, 1, "layers run jointly, each with its own random draws", low=1,
                    high=65536),
}


def _field_build(params: dict, seed: int, base: Path) -> Field:
    data, truth = components.build(params["per_head"], params["T"], params["kv_heads"], seed,
                                   params.get("layer", 0))
    return Field(data, truth)


def _field_describe(params: dict, base: Path) -> tuple[int, int, int, bool]:
    ropes = {c["qk"].get("rope_theta", 0.0) for c in params["per_head"] if "qk" in c}
    if len(ropes) > 1:
        raise KvsimError(f"expected one rope_theta for every head (a field has one RoPE), got "
                         f"{sorted(ropes)}", "qk.rope_theta")
    dims = {c["qk"]["dim"] for c in params["per_head"] if "qk" in c}
    if ropes and ropes.pop() and dims.pop() % 2:
        raise KvsimError("expected an even qk.dim with a RoPE (dimensions rotate in pairs)",
                         "qk.rope_theta")
    truth = any(
        (("heavy_hitters" in c and c["heavy_hitters"]["important"]
          and (c["heavy_hitters"]["count"] or c["heavy_hitters"]["fraction"]
               or c["heavy_hitters"]["positions"]))
         or any(b["important"] for b in c.get("boost", [])))
        for c in params["per_head"])
    return params["T"], params["heads"], params["kv_heads"], truth


FIELD = Source(
    "field", "a composed field: sinks, recency, heavy hitters, boosts, noise, query/key "
    "vectors; logits evaluated on the fly (O(T) memory)",
    FIELD_PARAMS, (), _field_describe, _field_build, lambda params, base: frozenset(
        (["keys", "queries"] if all("qk" in c for c in params["per_head"]) else [])
        + (["values"] if all(c.get("qk", {}).get("values") for c in params["per_head"]) else [])
        + (["rope"] if all(c.get("qk", {}).get("rope_theta") for c in params["per_head"])
           else [])),
    lambda params, base: tuple(range(params["layers"])))

TRACE = Source(
    "trace", "recorded post-RoPE queries, keys and values of a real model (.npz), with its "
    "pre-RoPE queries and RoPE settings from capture version 3; logits q . k / sqrt(d) on "
    "the fly",
    {
        "path": Param(str, None, "trace file, relative to the scenario file (or model + "
                                 "text + tokens)"),
        "model": Param(str, None, "instead of path: a model (smollm2-135m, gemma3-270m or a "
                                  "model folder) whose capture on text is cached on first use"),
        "text": Param(str, None, "text file the model reads, relative to the scenario file, or a "
                     "text shipped with kvsim (gpl-3)"),
        "tokens": Param(int, None, "tokens of the text captured", low=1),
        "gguf_file": Param(str, None, "GGUF weights inside a model folder"),
        "layer": Param(int, None, "model layer index (default: the first recorded)", low=0),
        "layers": Param(object, None, "model layers run jointly: a list, or \"all\"",
                        check=lambda v: v == "all" or (isinstance(v, list) and bool(v) and all(
                            isinstance(x, int) and not isinstance(x, bool) and x >= 0
                            for x in v) and len(set(v)) == len(v)),
                        expect='a non-empty list of distinct layer indices >= 0, or "all"'),
        "kv_head_ids": Param(list, [], "KV heads to replay, with their query heads (default all)",
                             check=lambda v: all(isinstance(x, int) and not isinstance(x, bool)
                                                 for x in v),
                             expect="a list of KV head indices"),
        "T": Param(int, None, "tokens replayed from the start (default: all recorded)", low=1),
        "gqa": FIELD_PARAMS["gqa"],
    }, (), trace.describe, lambda params, seed, base: Field(trace.build(params, seed, base),
                                                             None),
    trace.provides, trace.selected_layers, trace.rope_note)

SOURCES: dict[str, Source] = {s.name: s for s in (SEED_NOTEBOOK, MATRIX, FIELD, TRACE)}
