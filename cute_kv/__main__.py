"""``python -m cute_kv`` / ``cute-kv``: command-line tools, one subcommand per module (``inspect``, ``explain``,
``demo``, ``selftest``, ``prebuild``)."""

from __future__ import annotations

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """A usage error is one line on stderr and exit status 2 (argparse's default also dumps the usage)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    from cute_kv import demo as demo_command
    from cute_kv import explain_command
    from cute_kv import inspect as inspect_command
    from cute_kv import prebuild as prebuild_command
    from cute_kv import selftest as selftest_command

    parser = _Parser(prog="cute-kv", description="Paged KV cache tools (CuTe DSL, SM90/SM100).")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect_command.add_parser(commands)
    explain_command.add_parser(commands)
    demo_command.add_parser(commands)
    selftest_command.add_parser(commands)
    prebuild_command.add_parser(commands)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `cute-kv inspect ... | head`: stop quietly (Python's documented recipe)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
