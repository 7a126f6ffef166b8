"""``python -m kvsim``: see :mod:`kvsim.cli`."""

import importlib.util
import os
import signal
import sys
from pathlib import Path


def _own_package() -> None:
    """Make ``kvsim`` this package, whatever the working directory holds.

    ``python -m`` puts the working directory first on ``sys.path``, so a folder named
    ``kvsim`` there (the folder of a clone, say) is imported as an empty namespace package
    ahead of a kvsim installed behind a meta-path finder (an editable install), which
    still supplies this module. Replacing the namespace makes every later ``kvsim.x``
    import, and ``kvsim`` itself, resolve to this package only.
    """
    if getattr(sys.modules.get("kvsim"), "__file__", None) is not None:
        return  # the regular package
    here = Path(__file__).resolve().parent
    spec = importlib.util.spec_from_file_location(
        "kvsim", here / "__init__.py", submodule_search_locations=[str(here)])
    package = importlib.util.module_from_spec(spec)
    sys.modules["kvsim"] = package
    spec.loader.exec_module(package)


_own_package()

from kvsim.cli import main  # noqa: E402 (after the package is ours)
from kvsim.interrupts import SIGNALS  # noqa: E402

status = main()
for stop in SIGNALS:  # the run has ended (its report is written or not): a late signal
    signal.signal(stop, signal.SIG_IGN)  # must not turn its exit into a kill or a traceback
if status == 130:  # interrupted: policy threads still inside a kernel are not awaited
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
sys.exit(status)
