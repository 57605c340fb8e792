"""The ``shapewise`` command: ``shapewise demo``, ``shapewise plan FILE -k K``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

__all__ = ["main"]

COMMANDS = {
    "demo": ("shapewise.demo", "run the built-in toy transformer through the pipeline (CPU)"),
    "plan": ("shapewise.plan_cli", "choose bucket sizes from observed sizes"),
    "inspect": ("shapewise.inspect_cli", "run a model with every instrument on; write a dump folder"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: shapewise COMMAND [ARGS]\n\ncommands:")
        for name, (_, text) in COMMANDS.items():
            print(f"  {name:8} {text}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    import importlib

    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
