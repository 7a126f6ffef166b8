"""Shared pytest setup for kvsim's tests."""

import builtins
import os
import signal
import sys

import pytest

# Make the helper modules (reference.py, matrices.py) importable whatever the import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    # The tests that press Ctrl-C need SIGINT to reach Python, in this process and in the
    # runs it starts, even when the suite itself was started as a background job (whose
    # shell ignores SIGINT: an ignore that every child inherits, and Python keeps).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
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
