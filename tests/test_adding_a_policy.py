"""docs/adding-a-policy.md, run as written: its score-only rule (at most 30 lines) and its
per-step rule (at most 75) load through the registry route the page teaches (no circular
import) and match their reference entries (tests/reference.py, shown on the page as
written there) exactly, with each entry's variants, and one step at a time."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from policy_checks import check, check_stepper, field_source, qk_field, qkv_field, variants

import kvsim
from kvsim.policies import POLICIES

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "adding-a-policy.md"


def blocks() -> list[str]:
    """The page's Python blocks, in order."""
    return [part.split("```", 1)[0] for part in PAGE.read_text().split("```python\n")[1:]]


def test_the_rule_is_at_most_30_lines():
    assert len(blocks()[0].strip().splitlines()) <= 30


def test_the_per_step_rule_is_at_most_75_lines():
    assert len(blocks()[4].strip().splitlines()) <= 75


@pytest.mark.parametrize("name, at", [("vnorm", 2), ("decayed", 5)])
def test_the_page_shows_its_references_as_written(name, at):
    """The page's reference rules and table entries are lines of tests/reference.py."""
    text = (ROOT / "tests" / "reference.py").read_text()
    rule, entry = blocks()[at:at + 2]
    assert rule.strip() in text
    assert entry.rstrip() in text and entry.lstrip().startswith(f'"{name}": Reference(')


def registered(tmp_path, name: str, at: int):
    """The page's module at block ``at`` and its run-time registration, imported from a
    file; unregistered after."""
    path = tmp_path / f"{name}_example.py"
    path.write_text(blocks()[at] + "\n" + blocks()[1])
    spec = importlib.util.spec_from_file_location(f"{name}_example", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        assert POLICIES[name] is module.POLICY
        yield module
    finally:
        POLICIES.pop(name, None)


@pytest.fixture
def vnorm(tmp_path):
    yield from registered(tmp_path, "vnorm", 0)


@pytest.fixture
def decayed(tmp_path):
    yield from registered(tmp_path, "decayed", 4)


def test_the_rule_matches_its_reference(vnorm):
    rng = np.random.default_rng(23)
    compared = 0
    for kind in ("gauss", "ints", "pool"):
        for G, gqa in [(1, "mean"), (2, "max"), (3, "sum")]:
            T = int(rng.integers(6, 20))
            field = qk_field(rng, T, G, kind=kind)
            src = field_source(field)
            for params in variants("vnorm"):
                for P in (0, T // 2, T):
                    for B in (1, 3, T):
                        check(field, src, "vnorm", params, B, P, gqa, important=(0, T - 1))
                        compared += 1
    assert compared == 3 * 3 * len(variants("vnorm")) * 3 * 3 > 3 * 3 * 3 * 3


def test_the_rule_runs_one_step_at_a_time(vnorm):
    for heads, gqa in [(2, "mean"), (4, "max")]:
        field = qkv_field(heads, 2, seed=heads)
        for P, B in [(0, 1), (11, 4), (24, 6)]:
            for kv in range(2):
                check_stepper("vnorm", {"recent_ratio": 0.0}, field, kv, P, B, gqa)
                check_stepper("vnorm", {"recent_ratio": 0.5}, field, kv, P, B, gqa)


def test_the_per_step_rule_matches_its_reference(decayed):
    rng = np.random.default_rng(29)
    compared = 0
    for kind in ("gauss", "ints", "pool"):
        T = int(rng.integers(6, 24))
        field = qk_field(rng, T, 1, kind=kind)
        src = field_source(field)
        for params in variants("decayed"):
            for P in (0, T // 2, T):
                for B in (1, 3, T):
                    check(field, src, "decayed", params, B, P, important=(0, T - 1))
                    compared += 1
    assert compared == 3 * 3 * 3 * 3


def test_the_per_step_rule_runs_one_step_at_a_time(decayed):
    field = qkv_field(4, 2, seed=4)
    for P, B in [(0, 1), (11, 4), (24, 6)]:
        for kv in range(2):
            check_stepper("decayed", {"decay": 0.9}, field, kv, P, B, "mean")


def test_no_decay_is_tova_and_protocols_take_it(decayed):
    rng = np.random.default_rng(3)
    A = np.tril(np.exp(rng.standard_normal((60, 60))))
    A /= A.sum(axis=1, keepdims=True)
    tova = kvsim.simulate(A, "tova", 12, 30)
    again = kvsim.simulate(A, "decayed", 12, 30, decay=0.0)
    assert again.kept.tolist() == tova.kept.tolist()
    np.testing.assert_array_equal(again.mass, tova.mass)
    paged = kvsim.simulate(A, "decayed", 12, 30, page=4)
    assert paged.cache_size.max() <= 12


@pytest.mark.parametrize("name, at", [("vnorm", 0), ("decayed", 4)])
def test_the_registry_route_imports_without_a_cycle(tmp_path, name, at):
    """The module saved in the package, nothing else edited, imported first thing."""
    package = tmp_path / "kvsim"
    shutil.copytree(ROOT / "kvsim", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "policies" / f"{name}.py").write_text(blocks()[at])
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_DISABLE_JIT="1")
    for code in (f"import kvsim.policies.{name}", "import kvsim.policies",
                 f"from kvsim.protocols.run import get_policy; get_policy('{name}')"):
        proc = subprocess.run([sys.executable, "-c", code + "; import kvsim; "
                               f"assert '{name}' in kvsim.POLICIES; print(kvsim.__file__)"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == str(package / "__init__.py")
