"""User-facing errors and the wrapper that turns them into a clean exit.

A `UserError` is a mistake the user can fix (a bad param, a missing file, an
unreachable store). Stages print its message, with no traceback, and exit 1.
Anything else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """An error caused by the user's input; its message says what to change."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, with what the user does next (its message: `rerun the same command to resume from step 40`)."""


class Terminated(Interrupted):
    """SIGTERM (`kill`, Slurm's `scancel`, a preempted node), stopping the stage as a Ctrl-C does (the trials stopped,
    their checkpoints kept, their runs closed) where by default it died on the spot, its runs left RUNNING."""


_SIGTERMS: list[float] = []  # when SIGTERM came: Ray turns an exception its signal check meets into a bare Ctrl-C


def raise_on_sigterm() -> Any:
    """Have SIGTERM raise `Terminated` in the main thread; return the handler it replaces. `ray.init` puts its own in
    (an exit on the spot), so the trials' stage calls this again once Ray has started."""
    return signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, frame: Any) -> None:
    _SIGTERMS.append(time.time())
    raise Terminated()


def stopped_by_sigterm(stop: KeyboardInterrupt) -> bool:
    """Whether `stop` came of a SIGTERM: a `Terminated`, or the KeyboardInterrupt Ray raised in its place (a SIGTERM
    that arrived while the driver waited in Ray's C++ code)."""
    return isinstance(stop, Terminated) or bool(_SIGTERMS)


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
    previous = raise_on_sigterm()
    try:
        main()
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as stop:
        word, status = ("terminated", 128 + signal.SIGTERM) if stopped_by_sigterm(stop) else ("interrupted", 130)
        print(f"{word}; {stop}" if str(stop) else word, file=sys.stderr)
        sys.exit(status)
    finally:
        signal.signal(signal.SIGTERM, previous)
