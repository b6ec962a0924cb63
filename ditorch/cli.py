"""The ``ditorch`` console script: one entry point, one subcommand per tool.

Each layer owns its subcommands in its own module, which exposes
``register(subparsers) -> None`` adding its parsers with ``set_defaults(func=handler)``;
a handler takes the parsed ``argparse.Namespace`` and returns an exit code. Only the module
of the command being run is imported, so ``ditorch plan`` never pays for the C++ extension.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# command name -> module that registers it
COMMANDS: dict[str, str] = {
    "info": "ditorch.info",
    "data": "ditorch.data",
    "profile": "heteropp.runtime.profiler",
    "plan": "heteropp.cli",
    "simulate": "heteropp.cli",
    "hsr": "ditorch.hsr",
    "ps": "dips.cli",
    "volunteer": "volunteer.cli",
    "mre": "ditorch.tools.cli",
    "replay": "ditorch.tools.cli",
    "ft": "ditorch.ft",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The full parser, or one holding just the module that owns ``only``."""
    parser = argparse.ArgumentParser(prog="ditorch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = [COMMANDS[only]] if only in COMMANDS else sorted(set(COMMANDS.values()))
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # a layer not built yet must not hide the others
            if only is not None:
                raise
            sub.add_parser(
                next(c for c, m in COMMANDS.items() if m == name),
                help=f"(unavailable: {exc})",
            )
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``ditorch COMMAND ...``; returns the process exit code."""
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv and not argv[0].startswith("-") else None
    if command is not None and command not in COMMANDS:
        print(f"ditorch: unknown command {command!r}; expected one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    args = build_parser(command).parse_args(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
