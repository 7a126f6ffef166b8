"""kvsim's kernels leave torch's thread count alone.

The model studies hold torch to one thread (results then do not depend on the core count).
Asking Numba for its thread count starts its OpenMP pool, which resets the OpenMP thread
count torch shares: a task's decode then ran on every core, its small ops waiting on
spinning threads (and its numbers could depend on the machine). Run in a fresh process,
where nothing has started Numba's pool yet.
"""

import subprocess
import sys

import pytest

pytest.importorskip("torch")

SCRIPT = """
import numpy as np, torch
torch.set_num_threads(1)
x = torch.randn(500, 500); torch.softmax(x @ x, -1)  # torch's OpenMP runtime in use
from kvsim.attention.dense import probability_stack
from kvsim.protocols.stepping import Stepper
a = np.tril(np.ones((2100, 2100))); a /= a.sum(axis=1, keepdims=True)
probability_stack(a)  # large enough for the two-thread check
p = np.tril(np.ones((1, 40, 40))); p /= p.sum(axis=-1, keepdims=True)
Stepper("h2o", 16, prompt_attention=p, capacity_T=48)  # a full pass over the prompt
print(torch.get_num_threads())
"""


def test_kernels_keep_torch_on_one_thread():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "1"
