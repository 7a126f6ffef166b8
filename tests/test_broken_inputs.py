"""A corpus of broken inputs: every one ends in exit status 2 with one line naming the
key, no traceback and nothing written (field, notebook, trace and matrix sources, and
the command line). One data-driven test over the list of cases."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from broken import (DELETE, broken_deflate, cli, document, matrix, to_toml, trace_arrays,
                    write_data)
from kvsim.attention.components import COMPONENTS

NAN, INF = float("nan"), float("inf")


@dataclass(frozen=True)
class Case:
    """A broken input: ``base`` document with ``patch``, trace or matrix arrays changed by
    ``arrays``, extra command-line ``argv``; the one error line must start with ``expect``
    (after ``FILE: ``, or ``kvsim: `` for command-line problems)."""

    id: str
    base: str
    expect: str
    patch: dict = field(default_factory=dict)
    arrays: Callable | None = None  # changes the trace's dict of arrays, or returns a matrix
    argv: tuple = ()
    run: bool = False  # run rather than validate


def _floats() -> list[Case]:
    """Every float key of the field's components: nan, inf and -inf."""
    cases = []
    for comp, spec in COMPONENTS.items():
        for key, param in spec.items():
            if param.type is float:
                for bad in (NAN, INF, -INF):
                    path = f"attention.{comp}.{key}"
                    cases.append(Case(f"{path}={bad}", "field", path, {path: bad}))
    for bad in (NAN, INF, -INF):
        cases.append(Case(f"boost.strength={bad}", "field", "attention.boost[0].strength",
                          {"attention.boost[0].strength": bad}))
    return cases


def _ints() -> list[Case]:
    """Every int key of the field's components and shape: beyond int64."""
    cases = []
    for comp, spec in COMPONENTS.items():
        for key, param in spec.items():
            if param.type is int:
                path = f"attention.{comp}.{key}"
                cases.append(Case(f"{path}=2**64", "field", path, {path: 2**64}))
    for key in ("T", "heads", "kv_heads"):
        cases.append(Case(f"{key}=-2**70", "field", f"attention.{key}",
                          {f"attention.{key}": -2**70}))
    return cases


def _set(name, value):
    def change(a):
        a[name] = value
        return a
    return change


def _drop(name):
    def change(a):
        del a[name]
        return a
    return change


def _scaled(name, factor, dtype=np.float64):
    def change(a):
        a[name] = (a[name] * factor).astype(dtype)
        return a
    return change


def _entry(name, index, value):
    def change(a):
        a[name] = a[name].copy()
        a[name][index] = value
        return a
    return change


def _matrix(fn):
    return lambda: fn(matrix())


FIELD = _floats() + _ints() + [
    Case("T float", "field", "attention.T: expected int", {"attention.T": 1e9}),
    Case("T 2**40", "field", "attention.T: expected the run to fit in memory", {"attention.T": 2**40}),
    Case("T 10**9", "field", "attention.T: expected the run to fit in memory", {"attention.T": 10**9}),
    Case("T 0", "field", "attention.T", {"attention.T": 0}),
    Case("T string", "field", "attention.T", {"attention.T": "64"}),
    Case("heads 1e5", "field", "attention.heads", {"attention.heads": 100_000}),
    Case("heads 0", "field", "attention.heads", {"attention.heads": 0}),
    Case("kv_heads 0", "field", "attention.kv_heads", {"attention.kv_heads": 0}),
    Case("kv_heads 3", "field", "attention.kv_heads: expected a divisor", {"attention.kv_heads": 3}),
    Case("gqa", "field", "attention.gqa", {"attention.gqa": "median"}),
    Case("seeds empty", "field", "seeds", {"seeds": []}),
    Case("seeds negative", "field", "seeds", {"seeds": [-1]}),
    Case("seeds twice", "field", "seeds", {"seeds": [1, 1]}),
    Case("seeds float", "field", "seeds", {"seeds": [NAN]}),
    Case("budgets empty", "field", "experiment[0].budgets", {"experiment.budgets": []}),
    Case("budget 2**70", "field", "experiment[0].budgets[0]", {"experiment.budgets": [2**70]}),
    Case("budget > T", "field", "experiment[0].budgets[0]: expected a budget of at most T",
         {"experiment.budgets": [49]}),
    Case("budget nan", "field", "experiment[0].budgets[0]", {"experiment.budgets": [NAN]}),
    Case("budget inf", "field", "experiment[0].budgets[0]", {"experiment.budgets": [INF]}),
    Case("budget -1", "field", "experiment[0].budgets[0]", {"experiment.budgets": [-1]}),
    Case("budget twice", "field", "experiment[0].budgets[1]", {"experiment.budgets": [8, 8]}),
    Case("budget table", "field", "experiment[0].budgets", {"experiment.budgets": {"a": 1}}),
    Case("prompt_len -1", "field", "experiment[0].prompt_len", {"experiment.prompt_len": -1}),
    Case("prompt_len nan", "field", "experiment[0].prompt_len", {"experiment.prompt_len": NAN}),
    Case("prompt_len 2**70", "field", "experiment[0].prompt_len", {"experiment.prompt_len": 2**70}),
    Case("labels twice", "field", "experiment[0].policies[1]: expected distinct policy labels",
         {"experiment.policies": ["h2o", "h2o"]}),
    Case("labels empty", "field", "experiment[0].policies", {"experiment.policies": []}),
    Case("recent_ratio nan", "field", "policies.h2o.recent_ratio", {"policies.h2o.recent_ratio": NAN}),
    Case("recent_ratio inf", "field", "policies.h2o.recent_ratio", {"policies.h2o.recent_ratio": INF}),
    Case("snapkv window 2**63", "field", "policies.snapkv.window", {"policies.snapkv.window": 2**63}),
    Case("snapkv kernel even", "field", "policies.snapkv.kernel", {"policies.snapkv.kernel": 4}),
    Case("sinks 2**63", "field", "policies.streaming_llm.sinks", {"policies.streaming_llm.sinks": 2**63}),
    Case("sinks 2**62", "field", "experiment[0].budgets[0]",
         {"policies.streaming_llm.sinks": 2**62, "experiment.budgets": [8]}),
    Case("hh positions >= T", "field", "attention.heavy_hitters",
         {"attention.heavy_hitters.positions": [100]}),
    Case("hh positions negative", "field", "attention.heavy_hitters.positions",
         {"attention.heavy_hitters.positions": [-3]}),
    Case("hh hi -1", "field", "attention.heavy_hitters.hi", {"attention.heavy_hitters.hi": -1}),
    Case("hh fraction 2", "field", "attention.heavy_hitters.fraction",
         {"attention.heavy_hitters.fraction": 2.0}),
    Case("tau 0", "field", "attention.recency.tau", {"attention.recency.tau": 0.0}),
    Case("strength 1e300", "field", "attention.sinks.strength", {"attention.sinks.strength": 1e300}),
    Case("spread 1e39", "field", "attention.qk.spread", {"attention.qk.spread": 1e39}),
    Case("noise kind", "field", "attention.noise.kind", {"attention.noise.kind": "pink"}),
    Case("qk focus 0", "field", "attention.qk.focus", {"attention.qk.focus": 0}),
    Case("qk clusters 0", "field", "attention.qk.clusters", {"attention.qk.clusters": 0}),
    Case("qk dim 1e6", "field", "attention.qk.dim", {"attention.qk.dim": 10**6}),
    Case("boost queries 2**70", "field", "attention.boost[0].queries",
         {"attention.boost[0].queries": [5, 2**70]}),
    Case("boost key_positions -1", "field", "attention.boost[0].key_positions",
         {"attention.boost[0].keys": DELETE, "attention.boost[0].key_positions": [-1]}),
    Case("attention not a table", "field", "attention: expected a table", {"attention": 5}),
    Case("policies not a table", "field", "policies: expected a table", {"policies": 3}),
    Case("component not a table", "field", "attention.sinks: expected a table", {"attention.sinks": [1]}),
    Case("experiment a table", "field", "experiment", {"experiment": {"budgets": [8]}}),
    Case("output a list", "field", "output: expected a table", {"output": []}),
    Case("dpi nan", "field", "output.dpi", {"output.dpi": NAN}),
    Case("name slash", "field", "name", {"name": "a/b"}),
    Case("unknown top key", "field", "sead", {"sead": 1}),
    Case("source number", "field", "attention.source", {"attention.source": 5}),
    Case("sweep not a table", "field", "sweep", {"sweep": 5}),
    Case("sweep axis empty", "field", "sweep.attention.T", {"sweep": {"attention": {"T": []}}}),
    Case("sweep 10^8 points", "field", "sweep: expected at most",
         {"sweep": {"attention": {"sinks": {"count": list(range(10_000))},
                                  "noise": {"scale": [0.1] * 10_000}}}}),
    Case("sweep bad value", "field", "attention.T", {"sweep": {"attention": {"T": [48, NAN]}}}),
    Case("notebook T 2**40", "notebook", "attention.T: expected the run to fit in memory",
         {"attention.T": 2**40}),
    Case("notebook boost nan", "notebook", "attention.boost", {"attention.boost": NAN}),
    Case("notebook boost inf", "notebook", "attention.boost", {"attention.boost": INF}),
    Case("notebook noise nan", "notebook", "attention.noise", {"attention.noise": NAN}),
    Case("notebook noise -inf", "notebook", "attention.noise", {"attention.noise": -INF}),
    Case("notebook important > T", "notebook", "attention.important", {"attention.important": 49}),
]

TRACE = [
    Case("layer -1", "trace", "attention.layer: expected an integer >= 0", {"attention.layer": -1}),
    Case("layer absent", "trace", "attention.layer: expected one of the recorded layers [3, 7]",
         {"attention.layer": 5}),
    Case("layer nan", "trace", "attention.layer", {"attention.layer": NAN}),
    Case("T 0", "trace", "attention.T", {"attention.T": 0}),
    Case("T beyond", "trace", "attention.T: expected at most the recorded 32", {"attention.T": 33}),
    Case("kv_head_ids absent", "trace", "attention.kv_head_ids", {"attention.kv_head_ids": [5]}),
    Case("kv_head_ids twice", "trace", "attention.kv_head_ids", {"attention.kv_head_ids": [0, 0]}),
    Case("kv_head_ids huge", "trace", "attention.kv_head_ids", {"attention.kv_head_ids": [2**70]}),
    Case("path missing", "trace", "attention.path", {"attention.path": "nope.npz"}),
    Case("path folder", "trace", "attention.path", {"attention.path": "."}),
    Case("layers twice", "trace", "attention.path: expected layers", arrays=_set("layers", np.array([7, 7]))),
    Case("layers short", "trace", "attention.path: expected layers", arrays=_set("layers", np.array([7]))),
    Case("layers negative", "trace", "attention.path: expected layers", arrays=_set("layers", np.array([-3, 7]))),
    Case("layers float", "trace", "attention.path: expected layers", arrays=_set("layers", np.array([3.0, 7.0]))),
    Case("layers 2-D", "trace", "attention.path: expected layers", arrays=_set("layers", np.array([[3, 7]]))),
    Case("scaling negative", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array(-0.1))),
    Case("scaling zero", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array(0.0))),
    Case("scaling nan", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array(NAN))),
    Case("scaling inf", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array(INF))),
    Case("scaling vector", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array([0.1, 0.1]))),
    Case("scaling text", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array("big"))),
    Case("scaling bool", "trace", "attention.path: expected scaling", arrays=_set("scaling", np.array(True))),
    Case("queries nan", "trace", "attention.path: expected finite queries", arrays=_entry("queries", (1, 0, 3, 2), NAN)),
    Case("keys inf", "trace", "attention.path: expected finite keys", arrays=_entry("keys", (0, 1, 5, 0), INF)),
    Case("values nan", "trace", "attention.path: expected finite values", arrays=_entry("values", (0, 0, 0, 0), NAN)),
    Case("queries missing", "trace", "attention.path: expected an array 'queries'", arrays=_drop("queries")),
    Case("keys missing", "trace", "attention.path: expected an array 'keys'", arrays=_drop("keys")),
    Case("queries 3-D", "trace", "attention.path: expected queries", arrays=lambda a: {**a, "queries": a["queries"][0]}),
    Case("keys short", "trace", "attention.path: expected queries", arrays=lambda a: {**a, "keys": a["keys"][:, :, :20]}),
    Case("kv heads 3", "trace", "attention.path: expected KV heads", arrays=lambda a: {
        **a, "keys": np.concatenate([a["keys"], a["keys"][:, :1]], 1)}),
    Case("values shape", "trace", "attention.path: expected values", arrays=lambda a: {**a, "values": a["values"][:, :1]}),
    Case("values dv 0", "trace", "attention.path: expected values", arrays=lambda a: {**a, "values": a["values"][..., :0]}),
    Case("queries int", "trace", "attention.path: expected floating-point queries",
         arrays=lambda a: {**a, "queries": a["queries"].astype(np.int32)}),
    Case("queries huge", "trace", "attention.path: expected queries within", arrays=_scaled("queries", 1e35)),
    Case("logits overflow", "trace", "attention.path: expected logits", arrays=lambda a: _scaled("keys", 1e20)(
        _scaled("queries", 1e20)(a))),
    Case("T empty", "trace", "attention.path: expected queries", arrays=lambda a: {
        **a, "queries": a["queries"][:, :, :0], "keys": a["keys"][:, :, :0], "values": a["values"][:, :, :0]}),
    Case("empty npz", "trace", "attention.path: expected an array 'queries'", arrays=lambda a: {}),
    Case("npy as trace", "trace", "attention.path: expected a .npz trace", {"attention.path": "m.npy"}),
    Case("empty file", "trace", "attention.path: expected a readable", {"attention.path": "empty.npz"}),
    Case("text file", "trace", "attention.path: expected a readable", {"attention.path": "junk.npz"}),
    *[Case(f"deflate broken {where}{' (run)' if run else ''}", "trace",
           f"attention.path: expected a readable .npy or .npz file ({member}.npy: Error -3 "
           f"while decompressing data: invalid block type)",
           {"attention.path": f"deflate-{where}.npz"}, run=run)
      for where, member in (("header", "keys"), ("data", "queries")) for run in (False, True)],
]

MATRIX = [
    Case("nan", "matrix", "attention.path: head 0: expected finite values", arrays=_matrix(lambda m: _put(m, (3, 1), NAN))),
    Case("inf", "matrix", "attention.path: head 0: expected finite values", arrays=_matrix(lambda m: _put(m, (5, 5), INF))),
    Case("negative", "matrix", "attention.path: head 0: expected non-negative", arrays=_matrix(lambda m: _put(m, (4, 0), -0.5))),
    Case("non-causal", "matrix", "attention.path: head 0: expected a causal matrix", arrays=_matrix(lambda m: _put(m, (1, 9), 0.1))),
    Case("row sum", "matrix", "attention.path: head 0: expected rows summing to 1", arrays=_matrix(lambda m: m * 1.5)),
    Case("non-square", "matrix", "attention.path", arrays=_matrix(lambda m: m[:, :20])),
    Case("1-D", "matrix", "attention.path: expected shape", arrays=_matrix(lambda m: m[0])),
    Case("4-D", "matrix", "attention.path: expected shape", arrays=_matrix(lambda m: m[None, None])),
    Case("0x0", "matrix", "attention.path: expected shape", arrays=lambda: np.zeros((0, 0))),
    Case("heads x 0", "matrix", "attention.path: expected shape", arrays=lambda: np.zeros((2, 0, 0))),
    Case("ints", "matrix", "attention.path: head 0", arrays=lambda: np.zeros((4, 4), np.int64)),
    Case("complex", "matrix", "attention.path: head 0: expected float16, float32 or float64 numbers", arrays=_matrix(lambda m: m.astype(complex))),
    Case("bool", "matrix", "attention.path: head 0: expected float16, float32 or float64 numbers", arrays=lambda: np.tri(4, dtype=bool)),
    Case("logits nan", "matrix", "attention.path: head 0", {"attention.kind": "logits"},
         arrays=_matrix(lambda m: _put(np.log(m + 1e-9), (2, 1), NAN))),
    Case("kind unknown", "matrix", "attention.kind", {"attention.kind": "probs"}),
    Case("important negative", "matrix", "attention.important", {"attention.important": [-1]}),
    Case("important huge", "matrix", "attention.important", {"attention.important": [2**70]}),
    Case("important >= T", "matrix", "attention.important", {"attention.important": [24]}),
    Case("important floats", "matrix", "attention.important", {"attention.important": [1.5]}),
    Case("npz two arrays", "matrix", "attention.array", {"attention.path": "two.npz"}),
    Case("npz array absent", "matrix", "attention.array", {"attention.path": "two.npz", "attention.array": "zz"}),
    Case("npz important 2-D", "matrix", "attention.path: expected the array 'important'", {"attention.path": "imp2d.npz"}),
    Case("npz important range", "matrix", "attention.important", {"attention.path": "imprange.npz"}),
    Case("empty npz", "matrix", "attention.array", {"attention.path": "none.npz"}),
    Case("empty file", "matrix", "attention.path: expected a readable", {"attention.path": "empty.npz"}),
    Case("pickled", "matrix", "attention.path: expected a readable", {"attention.path": "pickled.npy"}),
    Case("missing", "matrix", "attention.path: expected an existing", {"attention.path": "gone.npy"}),
    Case("deflate broken", "matrix", "attention.path: expected a readable .npy or .npz file (attention.npy: Error -3",
         {"attention.path": "deflate-matrix.npz"}),
    Case("budget > T", "matrix", "experiment[0].budgets[0]", {"experiment.budgets": [25]}),
]

CLI = [
    Case("--budgets empty", "field", "kvsim: --budgets", argv=("--budgets", "")),
    Case("--budgets words", "field", "kvsim: --budgets", argv=("--budgets", "a,b")),
    Case("--policies empty", "field", "kvsim: --policies", argv=("--policies", "")),
    Case("--policies twice", "field", "kvsim: --policies: expected distinct", argv=("--policies", "h2o,h2o")),
    Case("--policies hole", "field", "kvsim: --policies", argv=("--policies", "h2o,,window")),
    Case("--policies unknown", "field", "policies.h2", argv=("--policies", "h2")),
    Case("--seeds empty", "field", "kvsim: --seeds", argv=("--seeds", "")),
    Case("--seeds reversed", "field", "kvsim: --seeds", argv=("--seeds", "5:2")),
    Case("--set T=abc", "field", "attention.T: expected int", argv=("--set", "attention.T=abc")),
    Case("--set T=nan", "field", "attention.T: expected int", argv=("--set", "attention.T=nan")),
    Case("--set strength=nan", "field", "attention.sinks.strength", argv=("--set", "attention.sinks.strength=nan")),
    Case("--set no value", "field", "kvsim: --set", argv=("--set", "attention.T")),
    Case("--set no key", "field", "kvsim: --set", argv=("--set", "=5")),
    Case("--set missing index", "field", "--set experiment[4].budgets", argv=("--set", "experiment[4].budgets=[4]")),
    Case("--set into a number", "field", "--set attention.T.x", argv=("--set", "attention.T.x=1")),
    Case("--workers 0", "field", "kvsim: argument --workers", argv=("--workers", "0"), run=True),
    Case("--workers word", "field", "kvsim: argument --workers", argv=("--workers", "many"), run=True),
    Case("--workers 2000", "field", "kvsim: argument --workers: expected an integer in [1, 1024]",
         argv=("--workers", "2000"), run=True),
    Case("unknown flag", "field", "kvsim: unrecognized arguments", argv=("--bogus",), run=True),
    Case("--max-memory word", "field", "kvsim: --max-memory", argv=("--max-memory", "lots")),
    Case("--max-memory 1K", "field", "attention.T: expected the run to fit in memory", argv=("--max-memory", "1K")),
    Case("--out under a file", "field", "kvsim: {dir}/s.toml/r: expected a folder path, got one inside the file {dir}/s.toml",
         argv=("--out", "{dir}/s.toml/r"), run=True),
    Case("--out in /proc", "field", "kvsim: /proc/kvsim-test/r: expected a report folder that can be written",
         argv=("--out", "/proc/kvsim-test/r"), run=True),
    Case("--out existing", "field", "kvsim: {dir}/taken: expected a new folder or a report kvsim wrote",
         argv=("--out", "{dir}/taken"), run=True),
    Case("scenario missing", "field", "{dir}/nothing.toml: expected an existing scenario file",
         argv=("{dir}/nothing.toml",)),
    Case("scenario a folder", "field", "{dir}: expected a readable UTF-8 text file (a folder, not a file)",
         argv=("{dir}",)),
    Case("scenario a FIFO", "field", "{dir}/fifo.toml: expected a readable UTF-8 text file (not a regular file)",
         argv=("{dir}/fifo.toml",)),
    Case("scenario /dev/zero", "field", "/dev/zero: expected a readable UTF-8 text file (not a regular file)",
         argv=("/dev/zero",)),
    Case("scenario not UTF-8", "field", "{dir}/latin1.toml: expected a readable UTF-8 text file (not UTF-8",
         argv=("{dir}/latin1.toml",)),
    Case("scenario a symlink loop", "field", "{dir}/loop.toml: expected a readable UTF-8 text file (Too many levels",
         argv=("{dir}/loop.toml",)),
    Case("scenario name too long", "field", "{dir}/" + "x" * 300 + ".toml: expected a readable UTF-8 text file (File name too long)",
         argv=("{dir}/" + "x" * 300 + ".toml",)),
    Case("--out name too long", "field", "kvsim: {dir}/" + "y" * 300 + "/r: expected a usable folder path",
         argv=("--out", "{dir}/" + "y" * 300 + "/r"), run=True),
    Case("--dask tcp://", "field", "kvsim: --dask: expected a scheduler address", argv=("--dask", "tcp://"), run=True),
    Case("--dask local:0", "field", "kvsim: --dask: expected local:N", argv=("--dask", "local:0"), run=True),
    Case("--dask local:-1", "field", "kvsim: --dask: expected local:N", argv=("--dask", "local:-1"), run=True),
    Case("--dask local:abc", "field", "kvsim: --dask: expected local:N", argv=("--dask", "local:abc"), run=True),
    Case("--dask local:10**6", "field", "kvsim: --dask: expected local:N", argv=("--dask", "local:1000000"), run=True),
    Case("--set into a swept key's part", "field", "--set: expected a key the file's [sweep] does not overwrite",
         {"sweep": {"experiment.prompt_len": [20, 24]}}, argv=("--set", "experiment[0].prompt_len=22")),
    Case("trace /dev/zero", "trace", "attention.path: expected an existing .npz trace", {"attention.path": "/dev/zero"}),
    Case("matrix a FIFO", "matrix", "attention.path: expected an existing .npy or .npz file",
         {"attention.path": "fifo.toml"}),
    Case("allocation unknown", "field", "experiment[0].allocation: expected one of",
         {"experiment.allocation": "greedy"}),
    Case("allocation pyramid one layer", "field", "experiment[0].allocation: expected a source with several layers",
         {"experiment.allocation": "pyramid"}),
    Case("floor_share without ada", "field", "experiment[0].floor_share: expected only with allocation = 'ada'",
         {"experiment.floor_share": 0.3}),
    Case("beta without pyramid", "field", "experiment[0].beta: expected only with allocation = 'pyramid'",
         {"experiment.beta": 3.0}),
    Case("floor_share nan", "field", "experiment[0].floor_share", {"experiment.allocation": "ada",
                                                                   "experiment.floor_share": NAN}),
    Case("floor_share 2", "field", "experiment[0].floor_share", {"experiment.allocation": "ada",
                                                                 "experiment.floor_share": 2.0}),
    Case("beta 0", "field", "experiment[0].beta", {"attention.layers": 2, "experiment.allocation": "pyramid",
                                                   "experiment.beta": 0.0}),
    Case("beta inf", "field", "experiment[0].beta", {"attention.layers": 2, "experiment.allocation": "pyramid",
                                                     "experiment.beta": INF}),
    Case("scenario not TOML", "field", "{dir}/junk.npz: expected", argv=("{dir}/junk.npz",)),
]

CASES = FIELD + TRACE + MATRIX + CLI


def _put(m, index, value):
    m = m.copy()
    m[index] = value
    return m


def _write_extras(folder: Path) -> None:
    (folder / "empty.npz").write_bytes(b"")
    (folder / "junk.npz").write_text("not numpy\n")
    m = matrix()
    np.savez(folder / "two.npz", a=m, b=m)
    np.savez(folder / "imp2d.npz", attention=m, important=np.array([[1, 2]]))
    np.savez(folder / "imprange.npz", attention=m, important=np.array([3, 40]))
    np.savez(folder / "none.npz")
    broken_deflate(folder / "deflate-header.npz", trace_arrays(), "keys")  # headers fail
    broken_deflate(folder / "deflate-data.npz", trace_arrays(), "queries", 0.5)  # data fail
    broken_deflate(folder / "deflate-matrix.npz", {"attention": m}, "attention", 0.5)
    np.save(folder / "pickled.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    os.mkfifo(folder / "fifo.toml")  # reading it would block
    (folder / "latin1.toml").write_bytes("name = \"caf\u00e9\"\n".encode("latin-1"))
    (folder / "loop.toml").symlink_to(folder / "loop.toml")
    (folder / "taken").mkdir()
    (folder / "taken" / "notes.txt").write_text("a folder kvsim did not write")


def test_bases_are_valid(tmp_path):
    write_data(tmp_path)
    for base in ("field", "notebook", "trace", "matrix"):
        path = tmp_path / f"{base}.toml"
        path.write_text(to_toml(document(base)))
        status, out, err = cli(["validate", path])
        assert status == 0 and err == "", err
        assert "cost:" in out and len(out.strip().splitlines()) == 1


def test_corpus_size():
    assert len(CASES) > 100
    assert len({c.id + c.base for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.base}:{c.id}" for c in CASES])
def test_broken_input(case: Case, tmp_path):
    write_data(tmp_path)
    _write_extras(tmp_path)
    if case.arrays is not None and case.base == "trace":
        np.savez(tmp_path / "trace.npz", **case.arrays(trace_arrays()))
    elif case.arrays is not None:
        np.save(tmp_path / "m.npy", case.arrays())
    path = tmp_path / "s.toml"
    path.write_text(to_toml(document(case.base, case.patch)))
    argv = [a.format(dir=tmp_path) for a in case.argv]
    if not argv or argv[0].startswith("--"):
        argv = [path, *argv]
    out = tmp_path / "report"
    if case.run:
        argv = [*argv, "--quiet"] + ([] if "--out" in argv else ["--out", out])
    else:
        argv = ["validate", *argv]
    before = set(os.listdir(tmp_path))
    status, stdout, stderr = cli(argv)
    lines = stderr.strip().splitlines()
    assert status == 2 and stdout == "" and len(lines) == 1, stderr
    expect = case.expect.format(dir=tmp_path)
    assert lines[0].startswith((expect, f"{path}: {expect}")), lines[0]
    assert set(os.listdir(tmp_path)) == before  # nothing written beside the inputs


CRASHED_BEFORE = ["attention.sinks.strength=nan", "attention.T=2000000000"]


@pytest.mark.parametrize("setting", CRASHED_BEFORE)
def test_no_signal_in_a_real_process(setting, tmp_path):
    """Inputs that once ended in a segfault: a separate process exits 2, one line."""
    path = tmp_path / "s.toml"
    path.write_text(to_toml(document("field")))
    proc = subprocess.run([sys.executable, "-m", "kvsim", path, "--set", setting, "--quiet",
                           "--out", tmp_path / "r"], capture_output=True, text=True,
                          cwd=Path(__file__).parents[1], timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "r").exists() and not list(tmp_path.glob(".r*"))
