"""How the CLI fails: a mistyped option, a user error, a reader that closed the pipe.

- An unknown option is reported by the command it was given to, with that command's usage and the
  closest option it has ("did you mean"), not by the top-level parser.
- errors.UserError: its message, no traceback.
- `torchcls predict --json ... | head`: when the reader stops early, the command ends quietly with the
  shell's code for a closed pipe (141), as `cat` or `yes` would, instead of a BrokenPipeError traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from torchcls.errors import UserError
from torchcls.suggest import closest

BROKEN_PIPE_EXIT = 128 + 13  # what a shell reports for a process ended by SIGPIPE


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command the arguments selected, e.g. `torchcls bench compile`'s."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name not in (subs[0].choices if subs else {}):
            return parser
        parser = subs[0].choices[name]


def unknown_arguments(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """'unrecognized arguments: ...' with the closest option of this command for each mistyped flag."""
    flags = [s for s in parser._option_string_actions if s.startswith("--")]
    hints = []
    for word in (w.split("=", 1)[0] for w in extra if w.startswith("-")):
        if match := closest(word, flags):
            hints.append(f"did you mean {match}?" if len(extra) <= 2 else f"{word}: did you mean {match}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f"; {'; '.join(hints)}" if hints else "")


def run(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> int:
    """Parse, run the command's function, and turn the failures above into messages and exit codes."""
    from torchcls.noise import silence_known_noise

    silence_known_noise()
    args, extra = parser.parse_known_args(argv)
    if extra:
        chosen_parser(parser, args).error(unknown_arguments(chosen_parser(parser, args), extra))
    try:
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe shows here rather than at interpreter exit
        return code
    except UserError as e:
        print(f"torchcls {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        # Python would try to flush stdout again at exit and print a second error: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT
