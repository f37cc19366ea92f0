"""Errors the commands report as one line, and the one place that reports them.

Importable without torch: the commands catch these before any model is loaded.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Tuple, Type


class CaptureError(RuntimeError):
    """The model cannot be captured as a graph. The message names the cause and a way out."""


class UsageError(ValueError):
    """A bad option value; the message says what is expected."""


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser (and its subcommands'), with a usage mistake as one line, the cause and
    where the options are listed, and exit code 2, instead of the whole usage text first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

    def _get_value(self, action: argparse.Action, arg_string: str):
        # an option given '' (`-o ''`, a shell variable left empty) is a mistake, not "left out": it would
        # write the default file, print to stdout, or skip what was asked
        if action.option_strings and not arg_string:
            self.error(f"argument {'/'.join(action.option_strings)}: an empty value; give one, or leave the option out")
        return super()._get_value(action, arg_string)


def run_subcommand(args: argparse.Namespace, user_errors: Tuple[Type[BaseException], ...], interrupted: str) -> int:
    """`args.func(args)`, with the user's mistakes (`user_errors`) as one line on stderr and exit
    code 2, never a traceback (PLANNER_TRACEBACK=1 shows it), Ctrl-C as `interrupted` and exit code 130, and a
    closed output pipe as one line and exit code 141."""
    try:
        return args.func(args)
    except user_errors as e:
        if os.environ.get("PLANNER_TRACEBACK"):  # for a bug report: the whole stack
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(interrupted, file=sys.stderr)
        return 130
    except BrokenPipeError:  # what read the output stopped (`| head`): stop too, as a killed pipe writer would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # interpreter exit flushes stdout again; into nothing now
        os.close(devnull)
        print("stopped: the command reading this output closed it", file=sys.stderr)
        return 141  # 128 + SIGPIPE, as a shell reports a writer the pipe killed
