"""User-facing errors and the wrapper that turns them into a clean exit.

A `UserError` is a mistake the user can fix (a bad param, a missing file, an
unreachable store). Stages print its message, with no traceback, and exit 1.
Anything else is a bug in this project and keeps its traceback.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn


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


def run_cli(main: Callable[[], None], arguments: bool = False) -> NoReturn:
    """Run a stage's `main` and end the process (`end_process`), turning a `UserError` into a one-paragraph message
    and exit code 1.

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
        end_process(1)
    except KeyboardInterrupt as stop:
        word, status = ("terminated", 128 + signal.SIGTERM) if stopped_by_sigterm(stop) else ("interrupted", 130)
        print(f"{word}; {stop}" if str(stop) else word, file=sys.stderr)
        end_process(status)
    finally:
        signal.signal(signal.SIGTERM, previous)
    end_process(0)


def end_process(code: int) -> NoReturn:
    """Exit with `code` as Python would, less its teardown of every loaded module, which ends a stage for nothing:
    1.1 s after torch and transformers, 0.3 s after MLflow (`python -c "import torch, transformers.modeling_utils"`
    against the same with `os._exit(0)`, measured on this project's 2-core host), paid by every train stage.
    Kept from a normal exit, in its order (CPython's `Py_FinalizeEx`): threading's shutdown (its exit hooks, such as
    thread pools', then waiting for non-daemon threads), the `atexit` handlers (logging's flush, MLflow's, Ray's
    shutdown), the standard streams flushed. A bug's traceback never comes here (it leaves `run_cli` as an
    exception), so its exit stays Python's own."""
    threading._shutdown()  # noqa: SLF001 - what Py_FinalizeEx calls first; a hand-written join would miss its hooks
    atexit._run_exitfuncs()  # noqa: SLF001 - the handlers a normal exit runs; os._exit alone would skip them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: as at a normal exit, nothing more to say
            pass
    os._exit(code)
