"""The ``sensai`` command line: thin wrappers that parse arguments and call library functions.

This package is the one layer that may import every other one (core, training, pruning,
serving); nothing imports it.  Each command group is a module here exposing
``register(subparsers)``; heavy libraries (torch, Ray, ONNX Runtime) are imported by the commands
that run, never while the parser is built, so ``sensai --help`` stays fast.  A command whose
defaults live in a heavy module passes ``arguments=`` to ``add_parser``: they are added only when
that command is parsed or its help is shown (:class:`CommandParser`).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from sensai.errors import SensaiError
from sensai.logs import configure as configure_logging

from . import bench, decompose, demo, perf, plan, predict, serve, train

COMMAND_GROUPS = (train, decompose, serve, predict, bench, plan, perf, demo)


class CommandParser(argparse.ArgumentParser):
    """A command's parser; ``arguments(parser)``, if given, adds its arguments the first time it
    parses or formats its help."""

    def __init__(self, *args, arguments: Callable[[argparse.ArgumentParser], None] | None = None,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.pending = arguments

    def complete(self) -> None:
        if self.pending is not None:
            add, self.pending = self.pending, None
            add(self)

    def parse_known_args(self, args=None, namespace=None):
        self.complete()
        return super().parse_known_args(args, namespace)

    def format_help(self) -> str:
        self.complete()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sensai", description="Class-parallel inference for convolutional networks (sensAI).")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=CommandParser)
    for group in COMMAND_GROUPS:
        group.register(sub)
    parser.commands = sub.choices  # each command's parser, by name
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser: its usage, "sensai CMD: error: ..."
        command = parser.commands.get(getattr(args, "command", None), parser)
        command.error(f"unrecognized arguments: {' '.join(unknown)}")
    configure_logging(args.verbose)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except SensaiError as e:
        print(f"sensai {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"sensai {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:  # pragma: no cover - console-script shim
    sys.exit(main())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
