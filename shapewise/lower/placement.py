"""How many compile worker processes a session starts (``shapewise.lower.workers`` runs them):
``compile_workers="auto"`` from the CPUs this process may use (``default_workers``), and each
worker's share of them for Inductor's compile threads (``worker_compile_threads``).

The workers are not confined to CPUs of their own: on an H100 machine of 16 CPUs without SMT
(2026-12-07, ``benchmarks/results/place_h100_20261207/``), 4 workers kept off a quarter of the CPUs
gave the first ``generate()`` of the 1B ``compile_generate`` in 30.8 s against 30.8-31.1 s on every
CPU: what slows the session beside its workers (its compile of the first size 7.95 s alone, 10.0-10.1
s beside them) is not a CPU they take from it."""

from __future__ import annotations

import os
from typing import Any

from shapewise.errors import ConfigError

__all__ = ["MAX_AUTO_WORKERS", "WORKERS_ENV", "default_workers", "resolve_workers", "worker_compile_threads"]

MAX_AUTO_WORKERS = 4


def _cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


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
    45.6 s: six starve the session's own compile (until then "auto" gave 8: half the CPUs). On an
    H100 machine (2026-12-07, a slow one: serial 122.1 s): 2 workers 47.7 / 60.8 s, 4 workers 54.1 /
    54.7 s. Two give the first call sooner, four every variant: four stay."""
    cpus = _share()
    return 1 if cpus < 8 else min(MAX_AUTO_WORKERS, cpus // 4)


def worker_compile_threads(workers: int) -> int:
    """Inductor's ``compile_threads`` in each of ``workers`` workers: this process's CPUs (``_share``)
    shared out among them (at least 1). Each would otherwise take the session's (Inductor's default: one per CPU, each a
    process of its own under its subprocess pool), so N workers would start N times as many compile
    processes as there are CPUs (on the H200's 16-CPU machine, 6 workers: 96). One thread each made
    the start slower (on an H100 machine, 2026-12-07: first ``generate()`` 58.7 s against 54.1 with
    4 threads each; the session's own compile of the first size 21.9 s against 14.1)."""
    return max(1, _share() // max(1, workers))


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
