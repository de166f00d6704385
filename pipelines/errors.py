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


def warn_user(message: str) -> None:
    """A one-line warning about the user's input that does not stop the run (stderr, as errors are)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def run_cli(main: Callable[[], None]) -> None:
    """Run a stage's `main`, turning a `UserError` into a one-paragraph message and exit code 1."""
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
