"""Kernel tuning results on disk, shared by every process that uses the folder (restarts,
tensor-parallel ranks): one small JSON file per key under ``<cache>/<kind>-tuning/``.

``<cache>`` is shapewise's cache folder (``shapewise.cache_dir``: ``$SHAPEWISE_CACHE_DIR``, else
``$XDG_CACHE_HOME/shapewise``, else ``~/.cache/shapewise``); ``SHAPEWISE_CACHE=0`` turns the store
off. Deleting the folder (``rm -r ~/.cache/shapewise/gemv-tuning``) clears it.

A key is a dict of everything that changes the answer (the GPU, versions, a hash of the kernel's
source, the shape); a file is named by the key's sha256 and holds the key itself, which a read
checks. Writes go to a temp file in the folder and are ``os.replace``d into place, so a reader
sees a whole file or none; ``locked(key)`` holds the key's ``filelock`` around a tune, so
processes sharing the folder tune each key once. A file that cannot be read or parsed is
ignored with a warning (the caller tunes again and overwrites it); a folder that cannot be
written costs one warning, and the results stay in memory.

>>> store = TuningStore.default("gemv")          # None when SHAPEWISE_CACHE=0
>>> store.load({"rows": 1, "n": 4096}, parse)    # MISSING, or parse(the stored value)
>>> store.save({"rows": 1, "n": 4096}, {"block_n": 16})
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from shapewise.cache_dir import cache_enabled, default_cache_dir

__all__ = ["MISSING", "TuningStore"]

log = logging.getLogger("shapewise")

FORMAT = 1
#: A process waiting for another one's tune of the same key gives up after this long and tunes
#: it itself (the write stays atomic either way).
LOCK_TIMEOUT_S = 600.0


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


#: What ``load`` returns for a key with no usable file (a stored value may itself be None).
MISSING: Any = _Missing()


class TuningStore:
    """Tuning results under ``folder``: ``<sha256 of key>.json``, locks beside them."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder).expanduser().absolute()
        self._write_failed = False

    def __repr__(self) -> str:
        return f"TuningStore({str(self.folder)!r})"

    @classmethod
    def default(cls, kind: str) -> TuningStore | None:
        """``<cache>/<kind>-tuning``, or None when ``SHAPEWISE_CACHE=0``."""
        return cls(default_cache_dir() / f"{kind}-tuning") if cache_enabled() else None

    def path(self, key: Mapping[str, Any]) -> Path:
        return self.folder / f"{_digest(key)}.json"

    def load(self, key: Mapping[str, Any], parse: Callable[[Any], Any] = lambda v: v) -> Any:
        """``parse(stored value)`` for ``key``; MISSING when there is no file, or (with a
        warning) when it is unreadable, garbage, for another key, or ``parse`` raises."""
        path = self.path(key)
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("format") != FORMAT or "value" not in data:
                raise ValueError("not a shapewise tuning file")
            if data.get("key") != _plain(key):
                raise ValueError("written for another key")
            return parse(data["value"])
        except FileNotFoundError:
            return MISSING
        except Exception as e:  # noqa: BLE001 - a broken file must never break a run
            log.warning("shapewise: ignoring the tuning file %s (%s: %s); tuning again", path, type(e).__name__, e)
            return MISSING

    def save(self, key: Mapping[str, Any], value: Any) -> bool:
        """Write ``value`` for ``key`` atomically; False (one warning per store) when it cannot."""
        path = self.path(key)
        text = json.dumps({"format": FORMAT, "key": _plain(key), "value": value}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.stem[:16]}.", suffix=".tmp", dir=self.folder)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
            return True
        except OSError as e:
            (log.debug if self._write_failed else log.warning)(
                "shapewise: cannot write tuning results to %s (%s); they stay in this process only", self.folder, e)
            self._write_failed = True
            return False
        finally:
            if tmp is not None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

    @contextlib.contextmanager
    def locked(self, key: Mapping[str, Any], wait: bool = True) -> Iterator[bool]:
        """Hold ``key``'s lock: yields True. With ``wait=False``, yields False at once when
        another process holds it (it is tuning that key). A lock that cannot be made (a
        read-only folder) or waited for past ``LOCK_TIMEOUT_S`` yields True, unlocked."""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            lock = FileLock(str(self.path(key).with_suffix(".lock")))
            lock.acquire(timeout=LOCK_TIMEOUT_S if wait else 0)
        except Timeout:
            if not wait:
                yield False
                return
            log.warning("shapewise: waited %.0f s for another process's tune of %s; tuning here", LOCK_TIMEOUT_S, key)
            lock = None
        except OSError as e:
            log.debug("shapewise: no lock for tuning in %s (%s); tuning unlocked", self.folder, e)
            lock = None
        try:
            yield True
        finally:
            if lock is not None:
                lock.release()


def _plain(key: Mapping[str, Any]) -> dict[str, Any]:
    """The key as JSON gives it back (tuples become lists), for comparing with a file's."""
    return json.loads(json.dumps(dict(key), sort_keys=True))


def _digest(key: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:32]
