"""Checks of the Python API's arguments: each bad value is a one-line :class:`KvsimError`.

Nothing is truncated or coerced: a float where an integer is due, a bool where a number
is due, a negative seed or an empty list is an error naming the argument.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np

from kvsim.errors import KvsimError

MAX_INDEX = 2**31 - 1  # budgets and prompt lengths: far beyond any context, within int64
MAX_SEED = 2**63 - 1
MAX_WORKERS = 1024


def integer(value, name: str, lo: int, hi: int) -> int:
    """``value`` as an int if it is an integer (not a bool) in ``[lo, hi]``."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise KvsimError(f"{name}: expected an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= int(value) <= hi:
        raise KvsimError(f"{name}: expected an integer in [{lo}, {hi}], got {int(value)}")
    return int(value)


def workers(value) -> int:
    """Threads (or processes) to use: ``value`` in [1, 1024], or every core if None."""
    if value is None:
        return os.cpu_count() or 1
    return integer(value, "workers", 1, MAX_WORKERS)


def flag(value, name: str) -> bool:
    """``value`` if it is a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise KvsimError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def items(value, name: str, what: str) -> list:
    """A non-empty list from a list, tuple or other iterable that is not a string (nor a
    0-d array: a single value, refused as a plain number is)."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable) \
            or np.ndim(value) == 0:
        raise KvsimError(f"{name}: expected a non-empty list of {what}, got {value!r}")
    out = list(value)
    if not out:
        raise KvsimError(f"{name}: expected a non-empty list of {what}, got an empty one")
    return out


def seeds(value, single) -> list[int]:
    """The seeds of a call: ``seeds`` (a list) or ``seed`` (one), distinct, >= 0."""
    if value is not None and single is not None:
        raise KvsimError("seeds: expected either seeds=[...] or seed=..., got both")
    if value is None:
        return [integer(0 if single is None else single, "seed", 0, MAX_SEED)]
    out = [integer(s, f"seeds[{i}]", 0, MAX_SEED) for i, s in enumerate(items(value, "seeds",
                                                                             "integers >= 0"))]
    if len(set(out)) != len(out):
        raise KvsimError(f"seeds: expected distinct seeds, got {out}")
    return out


def budgets(value, prompt_len: int, name: str = "budgets") -> list[int]:
    """Distinct token budgets (their floors are checked per policy later). As in a scenario
    file, a number in (0, 1] that is not an integer is a fraction of the prompt, rounded
    half up: ``0.25`` with ``prompt_len`` 1024 is 256 tokens."""
    out = []
    for i, b in enumerate(items(value, name, "token counts or prompt fractions")):
        if isinstance(b, (float, np.floating)) and 0.0 < b <= 1.0:
            tokens = int(float(b) * prompt_len + 0.5)
            if tokens < 1:
                raise KvsimError(f"{name}[{i}]: expected a budget of at least 1 token, got "
                                 f"{b!r} (resolves to {tokens} with prompt_len {prompt_len})")
        else:
            tokens = integer(b, f"{name}[{i}]", 1, MAX_INDEX)
        if tokens in out:
            raise KvsimError(f"{name}[{i}]: expected distinct budgets, got {b!r} again "
                             f"(= {tokens} tokens)")
        out.append(tokens)
    return out


def array(value, name: str) -> np.ndarray:
    """``value`` as a NumPy array: any array-like NumPy can read (views, memory maps,
    ``np.matrix``, masked arrays without masked entries, torch tensors of any dtype, with
    bfloat16 and other float types NumPy lacks widened exactly to float32). What NumPy
    cannot read is a one-line :class:`KvsimError`; dtypes are checked by the caller."""
    if type(value).__module__.split(".")[0] == "torch" and hasattr(value, "detach"):
        tensor = value.detach().cpu()
        try:
            return tensor.numpy()
        except TypeError:  # bfloat16, float8: no NumPy dtype; float32 holds them exactly
            if not tensor.is_floating_point():
                raise KvsimError(f"{name}: expected a float tensor, got dtype "
                                 f"{tensor.dtype}") from None
            return tensor.float().numpy()
    if isinstance(value, np.ma.MaskedArray):
        if np.ma.getmask(value) is not np.ma.nomask and np.ma.getmask(value).any():
            raise KvsimError(f"{name}: expected an array without masked entries, got "
                             f"{int(np.ma.count_masked(value))} masked")
        value = np.ma.getdata(value)
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError) as exc:
        raise KvsimError(f"{name}: expected an array NumPy can read, got "
                         f"{type(value).__name__} ({str(exc).splitlines()[0][:120]})") from None


def important(value, T: int, heads: int) -> np.ndarray | None:
    """An (H, T) mask from positions in ``[0, T)`` shared by every head (a position given
    twice counts once), or None."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or np.ndim(value) != 1:
        raise KvsimError(f"important: expected a 1-D list of positions, got {value!r}"[:200])
    pos = np.asarray(value)
    if pos.size == 0:
        raise KvsimError("important: expected at least one position (None: no ground truth), "
                         "got an empty list")
    if not np.issubdtype(pos.dtype, np.integer) or pos.dtype == bool:
        raise KvsimError(f"important: expected integer positions, got dtype {pos.dtype}")
    if pos.min() < 0 or pos.max() >= T:
        raise KvsimError(f"important: expected positions in [0, {T}), got "
                         f"{pos.min()}..{pos.max()}")
    mask = np.zeros((heads, T), bool)
    mask[:, pos] = True
    return mask
