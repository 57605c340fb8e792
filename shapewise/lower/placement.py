"""How many compile worker processes a session starts, and on which CPUs (``shapewise.lower.workers``
runs them): ``compile_workers="auto"`` from the CPUs this process may use (``default_workers``), each
worker's share of them for Inductor's compile threads (``worker_compile_threads``), and the CPUs the
workers are confined to, leaving whole cores to the session (``worker_cpus``)."""

from __future__ import annotations

import os
from typing import Any

from shapewise.errors import ConfigError

__all__ = ["CPUS_ENV", "MAX_AUTO_WORKERS", "RESERVE_ENV", "WORKERS_ENV", "default_workers", "resolve_workers",
           "worker_compile_threads", "worker_cpus"]

MAX_AUTO_WORKERS = 4


def _affinity() -> list[int]:
    """The CPUs this process may use, by number."""
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _cpus() -> int:
    """How many CPUs this process may use."""
    return len(_affinity())


def _cpu_list(text: str) -> set[int]:
    """The CPUs of a Linux CPU list ("0-3,8,10-11")."""
    found: set[int] = set()
    for part in text.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.strip().isdigit() and (not hi or hi.strip().isdigit()):
            found.update(range(int(lo), int(hi or lo) + 1))
    return found


def _core_of(cpu: int) -> frozenset[int]:
    """The CPUs that share ``cpu``'s core (its SMT siblings and itself), from Linux's topology files;
    just ``cpu`` where they cannot be read."""
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return frozenset(_cpu_list(f.read()) | {cpu})
    except OSError:
        return frozenset({cpu})


def _share() -> int:
    """This process's share of its CPUs: shared with the other processes of a ``torchrun`` on this
    host (its ``LOCAL_WORLD_SIZE``), at least 1."""
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, _cpus() // local)


def default_workers() -> int:
    """Worker processes for ``compile_workers="auto"``: a quarter of the CPUs this process may use
    (each worker's Inductor compiles Triton kernels on threads of its own, and the session compiles
    beside them), shared with the other processes of a ``torchrun`` on this host (its
    ``LOCAL_WORLD_SIZE``), at most ``MAX_AUTO_WORKERS``; 1 (none) below 8. On the H200 machine's 16
    CPUs (2026-12-06, the 1B ``compile_generate``, first ``generate()`` / every variant ready, of a
    serial start of 71.9-79.5 s): 2 workers 35.4 / 39.4 s, 4 workers 37.4 / 37.9 s, 6 workers 45.1 /
    45.6 s: six starve the session's own compile (until then "auto" gave 8: half the CPUs)."""
    cpus = _share()
    return 1 if cpus < 8 else min(MAX_AUTO_WORKERS, cpus // 4)


#: CPUs kept for the session where the workers are confined (``worker_cpus``): a number, or "auto" (the
#: default: a quarter of this process's CPUs, at least 2); 0 leaves the workers on every CPU.
RESERVE_ENV = "SHAPEWISE_WORKER_RESERVE"
# The environment variable through which a worker process learns its CPUs (set before it imports anything).
CPUS_ENV = "SHAPEWISE_WORKER_CPUS"


def _reserve(cpus: int) -> int:
    env = os.environ.get(RESERVE_ENV, "").strip()
    if env in ("", "auto"):
        return max(2, cpus // 4)
    if not (env.isascii() and env.isdecimal()):
        raise ConfigError(f"{RESERVE_ENV}={env!r}: expected a number of CPUs to keep for the session's own "
                          f"work (0: the workers may use every CPU) or 'auto' (a quarter of them)")
    return int(env)


def worker_cpus() -> list[int] | None:
    """The CPUs the compile workers (and their Inductor compile processes) are confined to: this
    process's CPUs but the first whole cores (SMT siblings together) that hold ``SHAPEWISE_WORKER_RESERVE``
    of them, kept for the session: its Dynamo trace and its compile of the size the first call waits
    for are on the start's critical path, and the workers, niced though they are, slowed both where
    they shared the CPUs (the 1B ``compile_generate`` on the H200 machine's 16 CPUs, 2026-12-07: the
    trace and the rest outside the variants 15.2-15.6 -> 17.1-19.2 s, the first size's compile 9.4 ->
    10.9-12.8 s beside 4 workers). The session is not pinned: the kernel's scheduler moves it to the
    CPUs the workers leave idle. None (no confinement): below 8 CPUs, under ``torchrun`` with several
    ranks on this host (each would keep the same cores), where the platform cannot pin a process, or
    with ``SHAPEWISE_WORKER_RESERVE=0``."""
    mine = _affinity()
    if len(mine) < 8 or _share() != len(mine) or not hasattr(os, "sched_setaffinity"):
        return None
    reserve = _reserve(len(mine))
    kept: set[int] = set()
    for cpu in mine:
        if len(kept) >= reserve:
            break
        kept |= _core_of(cpu) & set(mine)
    rest = [c for c in mine if c not in kept]
    return rest if reserve and len(rest) >= 2 else None


def worker_compile_threads(workers: int) -> int:
    """Inductor's ``compile_threads`` in each of ``workers`` workers: the workers' CPUs (``worker_cpus``;
    without confinement, this process's share, ``_share``) shared out among them (at least 1). Each
    would otherwise take the session's (Inductor's default: one per CPU, each a process of its own under
    its subprocess pool), so N workers would start N times as many compile processes as there are CPUs
    (on the H200's 16-CPU machine, 6 workers: 96)."""
    cpus = worker_cpus()
    return max(1, (len(cpus) if cpus else _share()) // max(1, workers))


#: What ``compile_workers="auto"`` (the default) means where it is set: a number of processes (1: none,
#: a switch for a whole job, e.g. a test suite or a machine shared with other work), or "auto".
WORKERS_ENV = "SHAPEWISE_COMPILE_WORKERS"


def resolve_workers(option: Any) -> int:
    """``compile_workers`` as a number of processes: ``"auto"`` is ``SHAPEWISE_COMPILE_WORKERS``
    where that is set, else ``default_workers()``."""
    if option != "auto":
        return int(option)
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env in ("", "auto"):
        return default_workers()
    if not (env.isascii() and env.isdecimal()) or int(env) < 1:
        raise ConfigError(f"{WORKERS_ENV}={env!r}: expected a number of compile worker processes >= 1 "
                          f"(1: none, compile in this process) or 'auto' (from the CPUs)")
    return int(env)
