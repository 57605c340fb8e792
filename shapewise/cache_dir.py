"""Where shapewise keeps what it writes to disk (compiled artifacts, kernel tuning results).

Below every other layer, so that the artifact cache (``shapewise.lower.cache``) and the kernels
(``shapewise.library.kernels``) find the same folder by the same rules.

>>> default_cache_dir()          # $SHAPEWISE_CACHE_DIR, else $XDG_CACHE_HOME/shapewise, else ~/.cache/shapewise
>>> cache_enabled()              # False when SHAPEWISE_CACHE=0 (or false, off, no)
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["OFF_VALUES", "cache_enabled", "default_cache_dir"]

#: Values of ``SHAPEWISE_CACHE`` that turn the disk cache off.
OFF_VALUES = ("0", "false", "off", "no")


def default_cache_dir() -> Path:
    """``$SHAPEWISE_CACHE_DIR``, else ``$XDG_CACHE_HOME/shapewise``, else ``~/.cache/shapewise``."""
    env = os.environ.get("SHAPEWISE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "shapewise"


def cache_enabled() -> bool:
    """Whether the disk cache is on by default: not when ``SHAPEWISE_CACHE=0``."""
    return os.environ.get("SHAPEWISE_CACHE", "1").strip().lower() not in OFF_VALUES
