"""User-facing errors and the wrapper that turns them into a clean exit.

A `UserError` is a mistake the user can fix (a bad param, a missing file, an
unreachable store). Stages print its message, with no traceback, and exit 1.
Anything else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """An error caused by the user's input; its message says what to change."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the user does next (its message: `rerun the same command to resume from step 40`)."""


def warn_user(message: str) -> None:
    """A one-line warning about the user's input that does not stop the run (stderr, as errors are)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[], None], arguments: bool = False) -> None:
    """Run a stage's `main`, turning a `UserError` into a one-paragraph message and exit code 1.

    A stage takes no arguments unless `arguments` (its `main` parses its own): `--help` is answered and anything
    else refused before `main` runs, so neither starts Ray, opens a run or writes a file
    (`pipelines.stage_help`)."""
    if not arguments:
        from pipelines.stage_help import parse_stage_arguments

        module = sys.modules[main.__module__]
        spec = getattr(module, "__spec__", None)
        parse_stage_arguments(spec.name if spec else main.__module__, module.__doc__, sys.argv[1:])
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as stop:
        print(f"interrupted; {stop}" if str(stop) else "interrupted", file=sys.stderr)
        sys.exit(130)
