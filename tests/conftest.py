"""Shared pytest setup for kvsim's tests."""

import os
import sys

# Make the helper modules (reference.py, matrices.py) importable whatever the import mode.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "quick: small, fast subset (also meant to run under NUMBA_DISABLE_JIT=1)",
    )
