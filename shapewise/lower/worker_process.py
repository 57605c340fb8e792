"""The entry point of a compile worker process: ``python -m shapewise.lower.worker_process``
(``shapewise.lower.workers``: tasks in on stdin, outcomes out on stdout).

Before anything is imported, the protocol takes stdout's file descriptor for itself and points
descriptor 1 at stderr: whatever torch, Triton or a compiler prints goes to stderr, never into
the pipe."""

import os
import sys

if __name__ == "__main__":
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from shapewise.lower.workers import serve

    serve(protocol)
