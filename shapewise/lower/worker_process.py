"""The entry point of a compile worker process: ``python -m shapewise.lower.worker_process``
(``shapewise.lower.workers``: tasks in on stdin, outcomes out on stdout).

Before anything is imported, the protocol takes stdout's file descriptor for itself and points
descriptor 1 at stderr: whatever torch, Triton or a compiler prints goes to stderr, never into
the pipe. Before that, the process confines itself to the CPUs the session left to the workers
(``SHAPEWISE_WORKER_CPUS``)."""

import os
import sys

if __name__ == "__main__":
    # The CPUs the session left to the workers (``shapewise.lower.placement.worker_cpus``), taken before
    # torch's import so that it, and the Inductor compile processes this one starts, run on them.
    cpus = os.environ.pop("SHAPEWISE_WORKER_CPUS", "")
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        except (OSError, ValueError) as e:  # (a CPU set this host refuses: the worker runs where it may)
            print(f"shapewise compile worker: not confined to CPUs {cpus}: {e}", file=sys.stderr)
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from shapewise.lower.workers import serve

    serve(protocol)
