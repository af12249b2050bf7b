"""Starting or joining Ray so that it cannot hang the command or end it in a traceback.

``ray.init`` runs for seconds (a local cluster starts its processes) or, given an address where
no cluster answers, retries inside Ray's C++ core for many minutes; while it is inside that code
Python runs no signal handler, so Ctrl-C and SIGTERM wait for it. ``guarded_init`` runs it with
a watcher thread that Python's own signal handler wakes through ``signal.set_wakeup_fd`` (a
write into a socket, done in C, whatever the main thread is doing):

* a SIGINT or SIGTERM while Ray starts: if the main thread gets the signal back (``ray.init``
  returns with ``KeyboardInterrupt`` or Ray's ``SystemExit``) it shuts Ray down and raises
  ``RayStartInterrupted``; if it is still stuck ``GRACE_S`` later, the watcher prints one line,
  kills the processes this command started (Ray's) and ends the process with exit code 130;
* joining a cluster (``address``) that has not answered in ``timeout_s``: one line naming the
  address and what to check, exit 2 (nothing was started or written).

``probe_address`` fails in a moment where nothing listens at all (a TCP connect refused, an
unknown host), before ``ray.init`` is called.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import sys
import threading
import time
from typing import Callable

GRACE_S = 3.0
"""How long the watcher leaves the main thread to handle a signal itself before ending the process."""

CONNECT_TIMEOUT_S = 45.0
"""How long joining a cluster may take before the command gives up (``ray.connect_timeout_s``)."""

PROBE_TIMEOUT_S = 5.0
"""How long ``probe_address`` waits for a TCP connection."""

INTERRUPTED = 130


class RayStartInterrupted(Exception):
    """SIGINT or SIGTERM while Ray was starting; Ray has been shut down. ``str``: the signal's name."""


class RayUnreachable(RuntimeError):
    """Nothing answers at the cluster's address (one line: the address and what to do)."""


def split_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``HOST:PORT`` address; None for the forms Ray resolves itself
    (``auto``, ``local``, ``ray://...``)."""
    if address in ("auto", "local") or "://" in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise RayUnreachable(f"--ray-address {address!r} is not HOST:PORT (the head's address, port 6379 unless "
                             f"`ray start --head --port` said otherwise)")
    return host.strip("[]") or "127.0.0.1", int(port)


def probe_address(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise ``RayUnreachable`` when nothing accepts a TCP connection at ``address``."""
    target = split_address(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout_s).close()
    except OSError as e:
        reason = e.strerror or type(e).__name__
        if isinstance(e, socket.timeout):
            reason = f"no answer in {timeout_s:g} s"
        raise RayUnreachable(f"nothing answers at --ray-address {address} ({reason}): start the cluster's head there "
                             f"(`ray start --head --port {target[1]}`) or give the address `ray start --head` "
                             f"printed") from None


AUTH_MODE, AUTH_TOKEN, AUTH_TOKEN_PATH = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
"""Ray's token auth settings: the mode (``token`` or ``disabled``), the token, a file holding it
(default ``~/.ray/auth_token``)."""


def token_at_hand() -> bool:
    """A Ray token this process would send: ``RAY_AUTH_TOKEN``, or the file ``RAY_AUTH_TOKEN_PATH``
    or ``~/.ray/auth_token`` names."""
    if os.environ.get(AUTH_TOKEN, "").strip():
        return True
    path = os.environ.get(AUTH_TOKEN_PATH) or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        with open(path) as f:
            return bool(f.read().strip())
    except OSError:
        return False


def use_token_if_at_hand() -> None:
    """Joining a cluster with ``RAY_AUTH_MODE`` unset and a token at hand: send it, as ``ray
    start --head`` uses a token it finds (Ray itself does so for ``address=auto`` only). A cluster
    without token auth accepts a driver that sends one."""
    if os.environ.get(AUTH_MODE) or not token_at_hand():
        return
    try:
        from ray._private.authentication.authentication_token_setup import (  # lazy: Ray's own switch
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # another Ray version: the user sets RAY_AUTH_MODE (join_hint says so)
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def join_hint() -> str:
    """What to set when joining a cluster failed: Ray's token auth is the usual cause."""
    if os.environ.get(AUTH_MODE, "").lower() == "token" and token_at_hand():
        return (f"if the cluster uses token auth, this command's token is not the cluster's: set {AUTH_TOKEN} to the "
                f"head's (`ray get-auth-token` on the head prints it)")
    return (f"if the cluster uses token auth (`ray start --head` turns it on where it finds a token), set "
            f"{AUTH_MODE}=token and {AUTH_TOKEN} to the head's token (`ray get-auth-token` on the head prints it)")


def descendants() -> list[int]:
    """The processes this one started, and theirs, all the way down (read from /proc)."""
    parent: dict[int, int] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            pass
    found, frontier = [], [os.getpid()]
    while frontier:
        kids = [pid for pid, ppid in parent.items() if ppid in frontier]
        found += kids
        frontier = kids
    return found


def kill_children() -> None:
    """SIGKILL every process this one started and theirs (a local Ray cluster's: GCS, raylet,
    its agents and workers), collected first so that none escapes by being re-parented."""
    for pid in descendants():
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _say_and_exit(line: str, code: int) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    finally:
        kill_children()
        os._exit(code)


def _watch(sock: socket.socket, done: threading.Event, seen: list, address: str | None, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s if address else None
    while not done.is_set():
        wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        if select.select([sock], [], [], wait)[0]:
            try:
                data = sock.recv(64)
            except (BlockingIOError, OSError):
                data = b""
            names = [signal.Signals(b).name for b in data if b in (signal.SIGINT, signal.SIGTERM)]
            if names:
                seen.append(names[0])
                if not done.wait(GRACE_S):  # the main thread is stuck inside Ray: end here
                    _say_and_exit(f"{names[0]}: interrupted while Ray was starting; nothing was started or written "
                                  f"(Ray's processes stopped)", INTERRUPTED)
                return
        if deadline is not None and time.monotonic() >= deadline and not done.is_set():
            _say_and_exit(f"ray error: the Ray cluster at --ray-address {address} did not answer within {timeout_s:g} s "
                          f"(ray.connect_timeout_s): check that a head runs there (`ray start --head`); "
                          f"{join_hint()}", 2)


def guarded_init(init: Callable[[], object], shutdown: Callable[[], None], address: str | None = None,
                 timeout_s: float = CONNECT_TIMEOUT_S):
    """``init()`` (``ray.init``), ended cleanly by a signal or by no answer from ``address`` (see
    the module docstring). Returns what ``init`` returned; raises ``RayStartInterrupted``."""
    if threading.current_thread() is not threading.main_thread():
        return init()
    reader, writer = socket.socketpair()
    reader.setblocking(False)
    writer.setblocking(False)
    seen: list[str] = []

    def handler(signum, frame):
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    old_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    done = threading.Event()
    watcher = threading.Thread(target=_watch, args=(reader, done, seen, address, timeout_s), daemon=True,
                               name="ray-start-watch")
    watcher.start()
    try:
        return init()
    except (KeyboardInterrupt, SystemExit) as e:  # SystemExit(15): Ray's own SIGTERM handler
        if isinstance(e, SystemExit) and e.code != signal.SIGTERM:
            raise
        done.set()
        shutdown()
        kill_children()  # what Ray's shutdown of a half-started cluster leaves (its agents)
        raise RayStartInterrupted("SIGTERM" if isinstance(e, SystemExit) else (seen or ["SIGINT"])[0]) from None
    finally:
        done.set()
        signal.set_wakeup_fd(old_fd)
        for sig, h in previous.items():
            signal.signal(sig, h)
        watcher.join(timeout=1.0)
        reader.close()
        writer.close()
