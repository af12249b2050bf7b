"""Ctrl-C while a command's imports load (torch and Ray take seconds): one line and exit 130
instead of a traceback from inside an import.

A command line imports this module before anything heavy; it installs its handler only when that
command is the module Python runs (``python -m megaslide_ray.train``), never when a program or a
test imports the command. The command's ``main`` puts Python's own handler back
(``restore``) and answers signals itself from there on."""

from __future__ import annotations

import signal
import sys

COMMANDS = ("megaslide_ray.train",)
"""The commands whose import is guarded."""


def _quit(signum, frame) -> None:
    sys.stderr.write("interrupted: nothing was started or written\n")
    sys.stderr.flush()
    raise SystemExit(130)


def restore() -> None:
    """Python's own SIGINT handler (KeyboardInterrupt) again, if this module's is installed."""
    if signal.getsignal(signal.SIGINT) is _quit:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_main = sys.modules.get("__main__")
if getattr(getattr(_main, "__spec__", None), "name", None) in COMMANDS \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, _quit)
