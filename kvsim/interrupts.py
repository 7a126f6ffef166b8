"""Steps that a stop signal must not cut in half.

The command line turns Ctrl-C, SIGTERM and SIGHUP into ``KeyboardInterrupt``, which can
strike between any two bytecodes: between the two renames of a report's replacement,
halfway through removing a folder, between creating a lock file and owning it. Inside
:func:`held`, such a signal waits; it is delivered, to the handler it would have met, as
soon as the block ends. And :func:`resend_swallowed` keeps a callback from swallowing one.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextmanager
def held():
    """Hold :data:`SIGNALS` for the block, then deliver the first that came (its Python
    handler is called: ``KeyboardInterrupt``; a default action is re-sent to this process;
    an ignored signal stays ignored). Outside the main thread (where handlers cannot be
    changed), a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in SIGNALS if signal.getsignal(s) is not None}  # None: not Python's
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if caught:
            handler = previous[caught[0]]
            if callable(handler):
                handler(caught[0], None)
            elif handler == signal.SIG_DFL:
                os.kill(os.getpid(), caught[0])


def resend_swallowed(unraisable) -> None:
    """A ``sys.unraisablehook``: a ``KeyboardInterrupt`` that a callback swallowed (one of
    llvmlite's, while Numba compiles in the main thread) is not printed but raised again:
    SIGTERM (whose handler, during a command, raises it) is sent to this process once the
    callback has returned, 50 ms on (sent at once, it would strike this hook; swallowed
    again, it is sent again). Anything else goes to Python's own hook."""
    if issubclass(unraisable.exc_type, KeyboardInterrupt):
        again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
        again.daemon = True
        again.start()
    else:
        sys.__unraisablehook__(unraisable)
