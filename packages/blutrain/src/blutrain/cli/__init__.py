"""The ``blutrain`` command: one subcommand per module under blutrain.cli."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Sequence

from blutrain.cli import plugins_command
from blutrain.cli.user_errors import exit_status, user_error_message


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="blutrain", description="BluTrain: train GPT-2-class models.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    plugins_command.add_command(sub)
    from blutrain.cli import train_command

    train_command.add_commands(sub)
    from blutrain.data.prepare import add_prepare_command

    add_prepare_command(sub)
    from blutrain.cli import memory_plot_command

    memory_plot_command.add_command(sub)
    from blutrain.cli import run_command

    run_command.add_command(sub)
    from blutrain.cli import export_command

    export_command.add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader went away (`blutrain plugins | head -n 1`): what it wanted was written; point stdout at
        # /dev/null so the interpreter's final flush does not raise again, and exit as a killed writer would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (Exception, KeyboardInterrupt) as exc:
        # the one place where a user's mistake becomes one line and a non-zero exit; a bug keeps its traceback
        message = user_error_message(exc)
        if message is None:
            raise
        status = exit_status(exc)
        sys.stdout.flush()
        kind = "" if status > 128 else "error: "  # an interrupt is the user's choice, not a mistake
        print(f"blutrain {args.command}: {kind}{message}", file=sys.stderr, flush=True)
        return status


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
