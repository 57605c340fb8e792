"""The entry point of a compile worker process: ``python -m shapewise.lower.worker_process``
(``shapewise.lower.workers``: tasks in on stdin, outcomes out on stdout)."""

from shapewise.lower.workers import serve

if __name__ == "__main__":
    serve()
