"""Where the built-in data sets live, and how one is built without ever leaving a half-made set.

A set is built in a temporary sibling directory and renamed into place when complete, so a
crash never leaves a folder that a later run would trust. A folder counts as complete when it
holds its marker, the file the build writes last (the demo set's manifest, the motion set's
``motion.json``); only the rename creates the final folder, so a folder there without the
marker was not made by this code and is refused rather than overwritten.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """``cache_dir`` (``data.cache_dir``) if given, else ``$MEGASLIDE_CACHE`` if set, else
    ``~/.cache/megaslide_ray``: the documented default of ``data.cache_dir``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("MEGASLIDE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "megaslide_ray"


def build_folder_atomically(final: Path, marker: str, build: Callable[[Path], None], what: str) -> None:
    """Make the folder ``final`` with ``build(folder)``, which fills an empty folder and writes
    ``marker`` last, unless ``final`` is already complete (holds ``marker``). ``what`` names the
    set in the log line. Two processes may build at once: the one that loses the rename keeps the
    winner's folder."""
    if (final / marker).is_file():
        return
    if final.exists():
        raise RuntimeError(f"{final} exists but holds no {marker}; remove it and run again")
    final.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its 0700 mode would survive the rename; mkdir honours the umask.
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        logger.info("building %s in %s", what, final)
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / marker).is_file():  # not a lost race with another builder: a real error
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
