"""The root cause of an error that crossed Ray: what a user reads first when a run fails.

An exception raised inside an actor reaches the driver wrapped (``RayTaskError``, whose
``cause`` is the original exception; an actor whose constructor raised becomes an
``ActorDiedError`` that carries only the text of the original traceback), and the printed
traceback runs to dozens of lines with the useful one in the middle. ``root_cause`` unwraps
them: the original exception's type and message, and which actor call raised it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ray.exceptions import ActorDiedError, RayActorError, RayTaskError

_LAST_ERROR = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)): (.+)$")
_CALL = re.compile(r"ray::(\S+?)\(\).*?pid=(\d+)")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class RootCause:
    kind: str      # the original exception's class name
    message: str   # its message
    where: str     # the actor call it was raised in ("" in the driver)

    def headline(self) -> str:
        """The message, with the exception's type unless it is a plain RuntimeError/ValueError or
        one of the project's own errors (whose messages say what went wrong themselves)."""
        plain = self.kind in ("RuntimeError", "ValueError") or self.kind.endswith(
            ("MismatchError", "LostError", "LimitError", "StepsError", "WriteError", "SpaceError", "DamagedError",
             "ConfigError"))
        return self.message if plain and self.message else f"{self.kind}: {self.message}".rstrip(": ")


def _from_text(text: str) -> tuple[str, str]:
    """The last ``Type: message`` line of a traceback's text."""
    for line in reversed(text.strip().splitlines()):
        m = _LAST_ERROR.match(line.strip())
        if m and not m.group(1).startswith("ray."):
            return m.group(1).rpartition(".")[2], m.group(2)
    return "", ""


def _where(error: RayTaskError) -> str:
    """The actor call a ``RayTaskError`` was raised in, from its header (the instance Ray builds
    as both a RayTaskError and its cause's class holds only the cause, no attributes)."""
    m = _CALL.search(_ANSI.sub("", str(error).split("\n", 1)[0]))
    return f"{m.group(1)} (pid {m.group(2)})" if m else ""


def root_cause(error: BaseException) -> RootCause:
    """Unwrap Ray's wrappers (nested ones too) down to the exception that started it."""
    where = ""
    for _ in range(16):
        if isinstance(error, RayTaskError):
            where = _where(error)
            cause = getattr(error, "cause", None)
            if isinstance(cause, BaseException) and cause is not error:
                error = cause
                continue
            kind, message = _from_text(str(error))
            return RootCause(kind or type(error).__name__, message or str(error), where)
        if isinstance(error, ActorDiedError) and error.actor_init_failed:
            kind, message = _from_text(error.error_msg)
            if kind:
                return RootCause(kind, message, "an actor's constructor")
        if isinstance(error, RayActorError):
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            return RootCause(type(error).__name__, first, where)
        break
    return RootCause(type(error).__name__, str(error), where)
