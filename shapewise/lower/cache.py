"""A content-keyed cache of compiled artifacts on disk, safe to share between processes.

Where: ``~/.cache/shapewise`` (``$XDG_CACHE_HOME/shapewise`` when set); ``SHAPEWISE_CACHE_DIR``
moves it, ``SHAPEWISE_CACHE=0`` (or ``cache=False`` in ``Lower`` / ``shapewise.compile``)
turns it off.

What: one file per (piece content, binding, compiler, build), named by the sha256 of all of
them, never by a position or a name (see ``shapewise.ir.keys``). Only Inductor artifacts are
cached: eager, aot_eager and callable backends produce nothing that can be saved. A file holds
a JSON header (key, the torch build, a checksum per section) and sections: Inductor's own
binary artifact (``CompiledArtifact.save(format="binary")``) and, on CPU, the compiled C++
kernel libraries it calls (Inductor keeps only their source, so a load in a fresh Inductor
cache would run the C++ compiler again).

How: writes go to a temp file in the same folder, are flushed and ``os.replace``d into place,
so a reader sees a whole file or none; a compile for a key holds that key's ``filelock``, so
processes sharing the folder compile each artifact once and the others load it. A file that
is truncated, garbage, or from another build is reported with a ``logging`` warning, removed,
recompiled and replaced.

>>> cache = ArtifactCache("/tmp/sw")        # or resolve_cache(None): the default, or None if off
>>> fn = cache.load("ab12...")              # None: not there (or unusable, with a warning)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from shapewise import _compat
from shapewise.cache_dir import cache_enabled, default_cache_dir
from shapewise.errors import ConfigError, ShapewiseError

__all__ = [
    "ArtifactCache",
    "CacheCorrupt",
    "default_cache_dir",
    "resolve_cache",
]

log = logging.getLogger("shapewise")

FORMAT = 1
MAGIC = b"SHAPEWISE-ARTIFACT\n"
SUFFIX = ".swa"
# A process waiting for another one's compile of the same artifact gives up after this long
# and compiles it itself (the write stays atomic either way).
LOCK_TIMEOUT_S = 900.0
_STALE_TEMP_S = 3600.0


class CacheCorrupt(ShapewiseError):
    """A cache file that cannot be used: truncated, garbage, or written by another build."""


def resolve_cache(option: Any) -> ArtifactCache | None:
    """``None``: on at ``default_cache_dir()`` unless ``SHAPEWISE_CACHE=0``; ``False``: off;
    ``True``: on at the default folder; a path: on at that folder; an ``ArtifactCache``: itself."""
    if isinstance(option, ArtifactCache):
        return option
    if option is None:
        if not cache_enabled():
            return None
        return ArtifactCache(default_cache_dir())
    if option is False:
        return None
    if option is True:
        return ArtifactCache(default_cache_dir())
    if isinstance(option, (str, os.PathLike)) and str(option):
        return ArtifactCache(Path(option).expanduser())
    raise ConfigError(f"cache must be None (default), True, False or a folder path, got {option!r}")


@dataclass
class Entry:
    """A verified cache file: its header and its sections by name."""

    header: dict[str, Any]
    sections: dict[str, bytes] = field(default_factory=dict)

    @property
    def kernels(self) -> list[tuple[str, bytes]]:
        return [(name[len("kernel:"):], data) for name, data in self.sections.items() if name.startswith("kernel:")]


def _build() -> dict[str, str]:
    fp = _compat.build_fingerprint()
    return {"torch": fp["torch"], "torch_git": fp["torch_git"], "python": fp["python"]}


def encode(key: str, sections: Mapping[str, bytes], info: Mapping[str, Any]) -> bytes:
    """A cache file: MAGIC, header length (8 bytes, big endian), JSON header, sections."""
    header = {
        "format": FORMAT,
        "key": key,
        **_build(),
        "info": dict(info),
        "sections": [{"name": n, "size": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in sections.items()],
    }
    head = json.dumps(header, sort_keys=True).encode()
    return b"".join([MAGIC, struct.pack(">Q", len(head)), head, *sections.values()])


def decode(data: bytes, key: str, section: str = "inductor") -> Entry:
    """Verify and split a cache file that must hold ``section`` (an Inductor artifact's, or a saved
    model's traces: ``shapewise.warm``); raises ``CacheCorrupt`` saying what is wrong."""
    if not data.startswith(MAGIC):
        if not data:
            raise CacheCorrupt("empty")
        raise CacheCorrupt("truncated" if MAGIC.startswith(data) else "not a shapewise artifact (bad magic)")
    pos = len(MAGIC)
    if len(data) < pos + 8:
        raise CacheCorrupt("truncated (no header)")
    (n,) = struct.unpack(">Q", data[pos:pos + 8])
    pos += 8
    if len(data) < pos + n:
        raise CacheCorrupt("truncated (header)")
    try:
        header = json.loads(data[pos:pos + n].decode())
        specs = [(str(s["name"]), int(s["size"]), str(s["sha256"])) for s in header["sections"]]
    except (ValueError, KeyError, TypeError) as e:
        raise CacheCorrupt(f"unreadable header ({type(e).__name__}: {e})") from None
    pos += n
    if header.get("format") != FORMAT:
        raise CacheCorrupt(f"written in format {header.get('format')!r}, this shapewise reads format {FORMAT}")
    if header.get("key") != key:
        raise CacheCorrupt(f"holds key {str(header.get('key'))[:16]}..., not the key it is filed under")
    here = _build()
    theirs = {k: header.get(k) for k in here}
    if theirs != here:
        raise CacheCorrupt(f"written by another build ({theirs}); this process runs {here}")
    sections: dict[str, bytes] = {}
    for name, size, digest in specs:
        chunk = data[pos:pos + size]
        if len(chunk) != size:
            raise CacheCorrupt(f"truncated (section {name!r})")
        if hashlib.sha256(chunk).hexdigest() != digest:
            raise CacheCorrupt(f"checksum mismatch in section {name!r}")
        sections[name] = chunk
        pos += size
    if pos != len(data):
        raise CacheCorrupt(f"{len(data) - pos} unexpected trailing bytes")
    if section not in sections:
        raise CacheCorrupt("no Inductor artifact section" if section == "inductor" else f"no {section!r} section")
    return Entry(header, sections)


class ArtifactCache:
    """Compiled artifacts under ``root``: ``root/v1/<key[:2]>/<key>.swa``, locks in ``root/locks``.

    ``load(key)`` returns a callable or None; ``store(key, artifact, info)`` saves one;
    ``compile_or_load(key, compile_fn, info)`` does the locked load → compile → store dance.
    Counters (``hits``, ``misses``, ``stores``, ``corrupt``) are per instance.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser().absolute()
        self.hits = self.misses = self.stores = self.corrupt = 0
        self._save_failures = 0

    def __repr__(self) -> str:
        return f"ArtifactCache({str(self.root)!r})"

    # -- layout ----------------------------------------------------------------------------
    def path(self, key: str) -> Path:
        if not key or not all(c in "0123456789abcdef" for c in key):
            raise ConfigError(f"a cache key is a lowercase hex digest, got {key!r}")
        return self.root / f"v{FORMAT}" / key[:2] / f"{key}{SUFFIX}"

    def lock(self, key: str, timeout: float = LOCK_TIMEOUT_S) -> FileLock:
        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(locks / f"{key}.lock"), timeout=timeout)

    def keys(self) -> list[str]:
        """Every key with a file in the cache, sorted."""
        base = self.root / f"v{FORMAT}"
        return sorted(p.name[: -len(SUFFIX)] for p in base.glob(f"*/*{SUFFIX}")) if base.is_dir() else []

    def _tmpdir(self) -> str:
        d = self.root / "tmp"
        d.mkdir(parents=True, exist_ok=True)
        return str(d)

    # -- reading -----------------------------------------------------------------------------
    def read(self, key: str, section: str = "inductor") -> Entry | None:
        """The verified entry for ``key`` (holding ``section``); None if absent; ``CacheCorrupt`` if unusable."""
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        return decode(data, key, section)

    def compiled_by(self, key: str) -> int | None:
        """The rank of torch.distributed that stored ``key`` (None if unknown)."""
        try:
            entry = self.read(key)
        except Exception:  # noqa: BLE001 - a report detail; load() deals with broken files
            return None
        rank = (entry.header.get("info") or {}).get("rank") if entry is not None else None
        return rank if isinstance(rank, int) else None

    def load(self, key: str, *, warn: bool = True) -> Callable[..., Any] | None:
        """The artifact for ``key`` loaded and callable, or None. An unusable file is reported
        (a warning when ``warn``), removed and counted in ``corrupt``."""
        try:
            entry = self.read(key)
            if entry is None:
                return None
            try:
                _compat.install_kernel_binaries(entry.kernels)
            except (ValueError, OSError) as e:
                raise CacheCorrupt(f"its kernel libraries cannot be installed ({e})") from None
            try:
                fn = _compat.load_artifact(entry.sections["inductor"], self._tmpdir())
            except Exception as e:  # noqa: BLE001 - Inductor asserts on a foreign build
                raise CacheCorrupt(f"Inductor could not load it ({type(e).__name__}: {e})") from None
        except CacheCorrupt as e:
            if warn:
                self.corrupt += 1
                log.warning("shapewise: cache file %s is unusable: %s; recompiling and replacing it", self.path(key), e)
                self.remove(key)
            return None
        except OSError as e:
            log.warning("shapewise: cannot read cache file %s (%s); compiling instead", self.path(key), e)
            return None
        self.hits += 1
        return fn

    # -- writing -----------------------------------------------------------------------------
    def write(self, key: str, sections: Mapping[str, bytes], info: Mapping[str, Any]) -> Path:
        """Atomically write an entry: temp file in the same folder, fsync, ``os.replace``."""
        path = self.path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        self._sweep(path.parent)
        data = encode(key, sections, info)
        fd, tmp = tempfile.mkstemp(prefix=f".{key[:16]}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.stores += 1
        return path

    def store(self, key: str, artifact: Any, info: Mapping[str, Any]) -> bool:
        """Save an Inductor artifact (and its CPU kernel libraries). False, with a log line,
        when the artifact cannot be saved; the compiled artifact is used either way."""
        from shapewise.lower.compile import RangeParts

        if isinstance(artifact, RangeParts):  # a range compiled in parts: not one artifact
            log.debug("shapewise: artifact %s... is compiled in parts, not cached", key[:12])
            return False
        try:
            sections = {"inductor": _compat.artifact_bytes(artifact, self._tmpdir())}
            for rel, data in _compat.kernel_binaries(artifact):
                sections[f"kernel:{rel}"] = data
            self.write(key, sections, info)
        except Exception as e:  # noqa: BLE001 - a cache that cannot save must not fail the compile
            self._save_failures += 1
            (log.warning if self._save_failures == 1 else log.debug)(
                "shapewise: could not save artifact %s... to the cache (%s: %s); the compiled artifact is used, "
                "it just will not be there next time", key[:12], type(e).__name__, e)
            return False
        return True

    def remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path(key).unlink()

    def clear(self) -> None:
        """Remove every entry (the folder itself stays)."""
        for k in self.keys():
            self.remove(k)

    def _sweep(self, folder: Path) -> None:
        # Temp files of processes that died mid-write: never read, removed when old.
        now = time.time()
        for p in folder.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - p.stat().st_mtime > _STALE_TEMP_S:
                    p.unlink()

    # -- the whole dance -----------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self, key: str) -> Iterator[bool]:
        """Hold ``key``'s lock (yields True); on timeout yields False and goes on unlocked."""
        lock = self.lock(key)
        try:
            lock.acquire()
        except Timeout:
            log.warning("shapewise: waited %.0f s for another process compiling %s...; compiling it here too",
                        LOCK_TIMEOUT_S, key[:12])
            yield False
            return
        try:
            yield True
        finally:
            lock.release()

    def compile_or_load(self, key: str, compile_fn: Callable[[], Any], info: Mapping[str, Any], *,
                        wait: bool = True) -> tuple[Callable[..., Any], str] | None:
        """Load ``key`` or compile it with ``compile_fn`` and store it: (callable, source) with
        source ``"cache"`` or ``"compiled"``. Another process compiling the same key is waited
        for and its result loaded; with ``wait=False`` it is not: None at once (come back later)."""
        fn = self.load(key, warn=False)  # lock-free: files only ever appear whole
        if fn is not None:
            return fn, "cache"
        if not wait:
            lock = self.lock(key, timeout=0)
            try:
                lock.acquire()
            except Timeout:
                return None
            try:
                return self._load_or_compile(key, compile_fn, info)
            finally:
                lock.release()
        with self.locked(key):
            return self._load_or_compile(key, compile_fn, info)

    def _load_or_compile(self, key: str, compile_fn: Callable[[], Any],
                         info: Mapping[str, Any]) -> tuple[Callable[..., Any], str]:
        """Under ``key``'s lock: the file (another process may have written it), else a compile, stored."""
        fn = self.load(key)
        if fn is not None:
            return fn, "cache"
        self.misses += 1
        artifact = compile_fn()
        self.store(key, artifact, info)
        return artifact, "compiled"
