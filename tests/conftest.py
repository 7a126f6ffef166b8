"""Shared pytest setup for kvsim's tests."""

import builtins
import os
import sys

import pytest

# Make the helper modules (reference.py, matrices.py) importable whatever the import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "quick: small, fast subset (also meant to run under NUMBA_DISABLE_JIT=1)",
    )


@pytest.fixture
def without_torch(monkeypatch):
    """``import torch`` fails, as where the capture extra is not installed."""
    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
