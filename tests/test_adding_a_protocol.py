"""docs/adding-a-protocol.md, run as written: its protocol (``evict_batch``), registered at
run time, matches a plain reference of its rule exactly; ``evict_batch = 1`` is the
per-step rule; what it does not fit is a one-line error; and the registry route the page
teaches (the module in the package, one line of settings.py) reaches the CLI and the API."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import _join, _Rule, compress_to
from test_protocols import REFERENCE, attention, check_reference

import kvsim
from kvsim.errors import KvsimError
from kvsim.policies import POLICIES
from kvsim.protocols import settings
from kvsim.protocols.settings import problem

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "adding-a-protocol.md"


def blocks() -> list[str]:
    """The page's Python blocks, in order."""
    return [part.split("```", 1)[0] for part in PAGE.read_text().split("```python\n")[1:]]


def evict_batch_caches(p, policy, P, T, B, params):
    """(prefill selection, [C_t]): when B keys are held, keep the B - N best, once."""
    rule = _Rule(policy, p, P, T, B, params)
    cache = rule.prefill(P, B)
    prefill, steps = list(cache), []
    for t in range(P, T):
        if len(cache) == B:
            cache = compress_to(rule, cache, B - params["evict_batch"], t)
        _join(rule, cache, t, steps)
    return prefill, steps


def test_the_page_shows_the_tests_reference_as_written():
    source = Path(__file__).read_text()
    assert blocks()[3].strip() in source


@pytest.fixture(scope="module")
def evict_batch(tmp_path_factory):
    """The page's module and its run-time registration, imported from a file."""
    module_code, register_block = blocks()[:2]
    path = tmp_path_factory.mktemp("protocol") / "evict_batch_example.py"
    path.write_text(module_code + "\n" + register_block)
    spec = importlib.util.spec_from_file_location("evict_batch_example", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        assert settings.PROTOCOLS[-1] is module.PROTOCOL
        yield module
    finally:
        settings.PROTOCOLS.remove(module.PROTOCOL)
        settings.PROTOCOL_PARAMS.pop("evict_batch")


def compare(A, name, N, B, P):
    """kvsim's cache at every step against the reference's (masses to 1e-9), within B."""
    got = check_reference(A, name, {"evict_batch": N}, B, P, reference=evict_batch_caches)
    assert got.cache_size.max(initial=0) <= B, f"{name} N={N} P={P} B={B}"


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_the_protocol_matches_its_reference(evict_batch, name):
    rng = np.random.default_rng(3 + sum(map(ord, name)))
    compared = 0
    for i in range(30):
        T = int(rng.integers(8, 40))
        P = [0, T, int(rng.integers(1, T))][i % 3]  # prompt 0, prompt = T, between
        floor = POLICIES[name].min_budget(REFERENCE[name])
        B = int(rng.integers(floor, max(floor + 1, P + 3)))
        N = int(rng.integers(1, B + 1))
        if problem(POLICIES[name], {**REFERENCE[name], "evict_batch": N}, B, P, T):
            continue
        compare(attention(rng, T), name, N, B, P)
        compared += 1
    assert compared >= 10


@pytest.mark.parametrize("name", ["h2o", "tova", "streaming_llm"])
def test_a_batch_of_one_is_the_per_step_rule(evict_batch, name):
    rng = np.random.default_rng(5)
    for _ in range(5):
        T = int(rng.integers(10, 40))
        P, B = int(rng.integers(0, T)), int(rng.integers(4, 12))
        A = attention(rng, T)
        one = kvsim.simulate(A, name, B, P, evict_batch=1, **REFERENCE[name])
        plain = kvsim.simulate(A, name, B, P, **REFERENCE[name])
        assert one.kept.tolist() == plain.kept.tolist()
        np.testing.assert_array_equal(one.mass, plain.mass)


def test_what_it_does_not_fit_is_a_one_line_error(evict_batch):
    A = attention(np.random.default_rng(1), 30)
    with pytest.raises(KvsimError, match=r"expected at most B - 2 = 6 \(its protected keys\), got 7"):
        kvsim.simulate(A, "streaming_llm", 8, 10, sinks=2, evict_batch=7)
    with pytest.raises(KvsimError, match="snapkv takes no evict_batch"):
        kvsim.simulate(A, "snapkv", 8, 10, window=2, evict_batch=2)
    with pytest.raises(KvsimError, match="expected one protocol"):
        kvsim.simulate(A, "h2o", 8, 10, evict_batch=2, interval=2)
    assert settings.label({"evict_batch": 4, "question_len": 2,
                           "compress": "before_question"}) \
        == "before_question(Q=2)+evict_batch=4"


SCENARIO = """name = "evict_batch"
[attention]
source = "field"
T = 256
heads = 2
[attention.recency]
kind = "power"
alpha = 0.7
[policies.h2o]
[policies.h2o_batch]
kind = "h2o"
evict_batch = 8
[[experiment]]
name = "decode"
prompt_len = 128
budgets = [32, 64]
[output]
formats = ["png"]
"""


def test_the_registry_route_reaches_the_cli_and_the_api(tmp_path):
    """The module saved in a copy of the package, its line added to settings.py: a
    scenario with the setting validates and runs, and a bad value is refused by name."""
    package = tmp_path / "kvsim"
    shutil.copytree(ROOT / "kvsim", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "protocols" / "evict_batch.py").write_text(blocks()[0])
    path = package / "protocols" / "settings.py"
    text = path.read_text()
    text = re.sub(r"from kvsim\.protocols import (.*)\n",
                  r"from kvsim.protocols import \1, evict_batch\n", text, count=1)
    text = text.replace("filtering.PROTOCOL]", "filtering.PROTOCOL,\n    evict_batch.PROTOCOL]")
    assert text.count("evict_batch") == 2
    path.write_text(text)
    scenario = tmp_path / "batch.toml"
    scenario.write_text(SCENARIO)
    env = dict(os.environ, PYTHONPATH=str(tmp_path), MPLBACKEND="Agg")
    for args in (["validate", str(scenario)], [str(scenario), "--out", str(tmp_path / "out")]):
        done = subprocess.run([sys.executable, "-m", "kvsim", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    rows = (tmp_path / "out" / "results.csv").read_text()
    assert "evict_batch=8" in rows
    bad = scenario.read_text().replace("evict_batch = 8", "evict_batch = 0")
    scenario.write_text(bad)
    done = subprocess.run([sys.executable, "-m", "kvsim", "validate", str(scenario)], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "policies.h2o_batch.evict_batch" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
