"""docs/adding-a-policy.md, run as written: its score-only rule is at most 30 lines, loads
through the registry route the page teaches (no circular import), and matches its
reference entry (tests/reference.py, shown on the page as written there) exactly, with
each of the entry's variants, on GQA groups and one step at a time."""

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

from kvsim.policies import POLICIES

ROOT = Path(__file__).parents[1]
PAGE = ROOT / "docs" / "adding-a-policy.md"


def blocks() -> list[str]:
    """The page's Python blocks, in order."""
    return [part.split("```", 1)[0] for part in PAGE.read_text().split("```python\n")[1:]]


def test_the_rule_is_at_most_30_lines():
    assert len(blocks()[0].strip().splitlines()) <= 30


def test_the_page_shows_its_reference_as_written():
    """The page's reference rule and table entry are lines of tests/reference.py."""
    text = (ROOT / "tests" / "reference.py").read_text()
    rule, entry = blocks()[2:4]
    assert rule.strip() in text
    assert entry.rstrip() in text and entry.lstrip().startswith('"vnorm": Reference(')


@pytest.fixture
def vnorm(tmp_path):
    """The page's module and its run-time registration, imported from a file."""
    rule, register_block = blocks()[:2]
    path = tmp_path / "vnorm_example.py"
    path.write_text(rule + "\n" + register_block)
    spec = importlib.util.spec_from_file_location("vnorm_example", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        assert POLICIES["vnorm"] is module.POLICY
        yield module
    finally:
        POLICIES.pop("vnorm", None)


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


def test_the_registry_route_imports_without_a_cycle(tmp_path):
    """The module saved in the package, nothing else edited, imported first thing."""
    package = tmp_path / "kvsim"
    shutil.copytree(ROOT / "kvsim", package, ignore=shutil.ignore_patterns("__pycache__"))
    (package / "policies" / "vnorm.py").write_text(blocks()[0])
    env = dict(os.environ, PYTHONPATH=str(tmp_path), NUMBA_DISABLE_JIT="1")
    for code in ("import kvsim.policies.vnorm", "import kvsim.policies",
                 "from kvsim.protocols.run import get_policy; get_policy('vnorm')"):
        proc = subprocess.run([sys.executable, "-c", code + "; import kvsim; "
                               "assert 'vnorm' in kvsim.POLICIES; print(kvsim.__file__)"],
                              env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == str(package / "__init__.py")
