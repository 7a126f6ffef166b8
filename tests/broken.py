"""Helpers for the broken-input corpus and the schema fuzzer: base documents of every
attention source, a small TOML writer, and the CLI run in-process."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import struct
import zlib
from pathlib import Path

import numpy as np

from kvsim.cli import main

FIELD = {
    "name": "f", "seeds": [0, 1],
    "attention": {
        "source": "field", "T": 48, "heads": 2, "kv_heads": 1, "gqa": "mean",
        "sinks": {"count": 2, "strength": 3.0},
        "recency": {"kind": "power", "alpha": 0.5, "tau": 16.0},
        "heavy_hitters": {"count": 3, "fraction": 0.0, "lo": 4, "hi": 40, "strength": 2.0,
                          "exponent": 1.0},
        "noise": {"kind": "gaussian", "scale": 0.5},
        "qk": {"dim": 8, "clusters": 3, "spread": 0.3, "focus": 1, "strength": 1.0},
        "boost": [{"keys": [2, 5], "queries": [20, 48], "strength": 2.0}],
    },
    "policies": {"window": {}, "streaming_llm": {"sinks": 2}, "h2o": {"recent_ratio": 0.5},
                 "snapkv": {"window": 4, "kernel": 3}},
    "experiment": [{"name": "e", "prompt_len": 24, "budgets": [8, 0.5]}],
    "output": {"formats": ["png"], "dpi": 60},
}
NOTEBOOK = {
    "attention": {"source": "seed_notebook", "T": 48, "important": 4, "boost": 8.0,
                  "noise": 0.1},
    "policies": {"h2o_offline": {}, "tova": {}},
    "experiment": [{"prompt_len": 32, "budgets": [8]}],
}
TRACE = {
    "attention": {"source": "trace", "path": "trace.npz", "layer": 7, "gqa": "max"},
    "policies": {"h2o": {}, "window": {}},
    "experiment": [{"prompt_len": 16, "budgets": [8]}],
}
MATRIX = {
    "attention": {"source": "matrix", "path": "m.npy"},
    "policies": {"h2o": {}, "oracle": {}},
    "experiment": [{"prompt_len": 12, "budgets": [6]}],
}
BASES = {"field": FIELD, "notebook": NOTEBOOK, "trace": TRACE, "matrix": MATRIX}


def trace_arrays() -> dict[str, np.ndarray]:
    """A valid trace: 2 layers (model layers 3 and 7), 4 query heads on 2 KV heads."""
    rng = np.random.default_rng(1)
    return {"queries": rng.standard_normal((2, 4, 32, 8)).astype(np.float32),
            "keys": rng.standard_normal((2, 2, 32, 8)).astype(np.float32),
            "values": rng.standard_normal((2, 2, 32, 8)).astype(np.float32),
            "layers": np.array([3, 7]), "scaling": np.array(0.3)}


def matrix() -> np.ndarray:
    """A valid (24, 24) causal probability matrix."""
    rng = np.random.default_rng(2)
    m = np.tril(rng.random((24, 24)) + 0.1)
    return m / m.sum(axis=1, keepdims=True)


def write_data(folder: Path) -> None:
    """The data files the trace and matrix bases name."""
    np.savez(folder / "trace.npz", **trace_arrays())
    np.save(folder / "m.npy", matrix())


def broken_deflate(path: Path, arrays: dict[str, np.ndarray], member: str,
                   at: float = 0.0) -> None:
    """An ``.npz`` of ``arrays``, compressed, whose member ``member`` has a broken deflate
    stream: a valid zip directory and CRC-32, but the block starting at fraction ``at`` of
    the member's bytes (0: the ``.npy`` header) has an invalid block type."""
    data, directory = bytearray(), bytearray()
    for name, a in arrays.items():
        buffer = io.BytesIO()
        np.save(buffer, a)
        raw, name = buffer.getvalue(), f"{name}.npy".encode()
        deflate = zlib.compressobj(6, zlib.DEFLATED, -15)
        cut = int(len(raw) * at) if name == f"{member}.npy".encode() else len(raw)
        head = deflate.compress(raw[:cut]) + deflate.flush(zlib.Z_FULL_FLUSH)  # byte-aligned
        body = bytearray(head + deflate.compress(raw[cut:]) + deflate.flush())
        if cut < len(raw):
            body[len(head)] = 0xFF  # BFINAL 1, BTYPE 11: a block type deflate does not have
        crc, offset = zlib.crc32(raw), len(data)
        data += struct.pack("<IHHHHHIIIHH", 0x04034B50, 20, 0, 8, 0, 0x21, crc, len(body),
                            len(raw), len(name), 0) + name + body
        directory += struct.pack("<IHHHHHHIIIHHHHHII", 0x02014B50, 20, 20, 0, 8, 0, 0x21, crc,
                                 len(body), len(raw), len(name), 0, 0, 0, 0, 0, offset) + name
    n = len(arrays)
    path.write_bytes(bytes(data + directory + struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, n, n, len(directory), len(data), 0)))


def _key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else json.dumps(k)


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf") if math.isinf(v) \
            else repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_key(k)} = {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _is_tables(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def to_toml(doc: dict) -> str:
    """TOML text of ``doc`` (tables and arrays of tables as sections)."""
    lines: list[str] = []

    def emit(table: dict, path: list[str], header: str | None) -> None:
        if header:
            lines.append(header)
        for k, v in table.items():
            if not isinstance(v, dict) and not _is_tables(v):
                lines.append(f"{_key(k)} = {_value(v)}")
        for k, v in table.items():
            name = ".".join(_key(p) for p in path + [k])
            if isinstance(v, dict):
                emit(v, path + [k], f"[{name}]")
            elif _is_tables(v):
                for item in v:
                    emit(item, path + [k], f"[[{name}]]")

    emit(doc, [], None)
    return "\n".join(lines) + "\n"


def document(base: str, patch: dict | None = None) -> dict:
    """A copy of base ``base`` with ``patch`` (dotted path -> value, DELETE removes) applied."""
    from kvsim.scenario.overrides import assign

    doc = copy.deepcopy(BASES[base])
    for path, value in (patch or {}).items():
        if value is DELETE:
            assign(doc, path, None)
            _drop_none(doc)
        else:
            assign(doc, path, value)
    return doc


DELETE = object()


def _drop_none(table):
    for k in [k for k, v in table.items() if v is None]:
        del table[k]
    for v in table.values():
        for t in (v if isinstance(v, list) else [v]):
            if isinstance(t, dict):
                _drop_none(t)


def cli(argv: list[str]) -> tuple[int, str, str]:
    """Run the command line in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in argv])
    return status, out.getvalue(), err.getvalue()
