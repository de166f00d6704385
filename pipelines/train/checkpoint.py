"""Training checkpoints that carry the params they were made with.

A checkpoint holds everything needed to continue bit-for-bit on the same device: model,
optimizer, scheduler and scaler state, the torch RNG (dropout), the position in the
epoch's deterministic batch list, and the loop's running counters. Resuming under
different params is refused (the run starts fresh) and the differing keys are named.
Files are written to a temporary name and renamed, and read with `weights_only=True`.
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipelines.params import Params, flatten_params

if TYPE_CHECKING:
    from pipelines.train.step import TrainStep

CHECKPOINT_FILE = "checkpoint.pt"
PARAMS_FILE = "params.json"


@dataclass
class LoopState:
    """Where the loop is and what it has counted so far (saved in every checkpoint)."""

    epoch: int = 0
    window: int = 0  # accumulation windows (optimizer steps) of `epoch` already done
    oom_halvings: int = 0  # times micro-batches were halved after running out of memory
    nonfinite_consecutive: int = 0  # optimizer steps in a row whose loss was NaN/inf (as of the last log point)
    nonfinite_total: int = 0
    skipped_total: int = 0  # optimizer steps not applied: their gradients held a NaN/inf (as of the last log point)
    step: int = 0  # optimizer steps taken
    rows_timed: int = 0  # rows and real tokens of the timed steps (every step but the warm-up one)
    tokens_timed: int = 0
    positions_timed: int = 0  # real tokens plus padding
    data_wait_s: float = 0.0  # waiting for batches, within the timed steps
    clocks: dict[str, float] = field(default_factory=dict)  # seconds per region (see pipelines/train/timing.py)
    step_times: list[float] = field(default_factory=list)
    history: list[dict[str, float]] = field(default_factory=list)
    logged_loss: float = 0.0  # loss summed over windows since the last logged point
    logged_windows: int = 0
    peak_grad_bytes: int = 0
    memory: dict[str, float] = field(default_factory=dict)  # the memory probe's peak and breakdown
    cuda_peak_allocated: int = 0  # CUDA allocator peaks of the training segments before the last reset
    cuda_peak_reserved: int = 0
    val_metrics: dict[str, float] = field(default_factory=dict)

    def add_timed(self, rows: int, tokens: int, positions: int, wait_s: float) -> None:
        """Count a timed window's examples, real tokens, padded positions and data wait."""
        self.rows_timed += rows
        self.tokens_timed += tokens
        self.positions_timed += positions
        self.data_wait_s += wait_s


def _training_params(params: Params) -> dict[str, Any]:
    # Tracking and tune settings don't change the run's numbers; logging cadence doesn't either.
    flat = flatten_params(params)
    return {k: v for k, v in flat.items() if not k.startswith(("tracking.", "tune."))}


def checkpoint_key(params: Params) -> str:
    """A short hash of the params a checkpoint resumes: runs with other training params never share a folder."""
    blob = json.dumps(_training_params(params), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


LOCK_FILE = ".lock"


@contextmanager
def claim_checkpoint_dir(root: Path, params: Params) -> Iterator[Path]:
    """This run's checkpoint folder, `root/<checkpoint_key>`, held under an exclusive lock while the block runs.

    The key makes a crashed run's re-run find its checkpoint. The lock (an `flock`, released by
    the kernel when the process dies, `kill -9` included) keeps two live runs with the same params
    (two queued DVC experiments) apart: the second gets `<key>-1`, and so on, so no run resumes,
    overwrites or deletes another's checkpoint. The lock's file goes with the block (an empty folder too), and a
    process that died holding it leaves one that `remove_unheld_locks` removes.
    """
    key = checkpoint_key(params)
    for attempt in itertools.count():
        folder = root / (key if attempt == 0 else f"{key}-{attempt}")
        fd = _lock(folder)
        if fd is None:
            continue
        try:
            yield folder
        finally:
            _unlock(folder, fd)
        return


def _lock(folder: Path) -> int | None:
    """An open, exclusively locked descriptor of `folder`'s lock file; None when a live process holds it."""
    while True:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder was removed as empty between the two calls: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _same_file(fd, folder / LOCK_FILE):
            return fd
        # Its holder removed the file while this process waited on it: the lock is of a file no one else sees.
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _unlock(folder: Path, fd: int) -> None:
    """Remove the lock's file while still holding it (a process that opened it meanwhile finds it gone, see `_lock`),
    release it, and remove the folder if nothing else is left in it."""
    with suppress(FileNotFoundError):  # a finished run's folder is already gone (`discard`)
        os.unlink(folder / LOCK_FILE)
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)
    with suppress(OSError):  # not empty: its checkpoint is kept for the next run to resume
        folder.rmdir()


def remove_unheld_locks(root: Path, wait_s: float = 10.0) -> list[Path]:
    """Remove every lock file under `root` that no live process holds (one whose process was killed, as Ray stops a
    trial), waiting up to `wait_s` for those still held to be let go; return the folders still held then."""
    deadline = time.monotonic() + wait_s
    held = sorted(lock.parent for lock in root.glob(f"*/{LOCK_FILE}"))
    while True:
        for folder in list(held):
            fd = _lock(folder)
            if fd is not None:
                _unlock(folder, fd)
                held.remove(folder)
        if not held or time.monotonic() > deadline:
            return held
        time.sleep(0.2)


def save_checkpoint(folder: Path, params: Params, state: LoopState, step: TrainStep, scheduler: Any) -> None:
    """Write a checkpoint atomically into `folder` (replacing the previous one): the step's model, optimizer and
    scaler, the schedule, the RNG and the loop's state."""
    payload = {
        "model": step.model.state_dict(),
        "optimizer": step.optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": step.scaler.state_dict(),
        **{f"rng_{device}": state for device, state in rng_state().items()},
        "state": json.dumps(asdict(state)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="checkpoint-", suffix=".pt.tmp", dir=folder)
    os.close(fd)
    torch.save(payload, tmp)
    os.replace(tmp, folder / CHECKPOINT_FILE)
    write_params(folder, params)


def find_resumable(folder: Path, params: Params) -> tuple[dict[str, Any] | None, str]:
    """Return (checkpoint payload or None, a sentence saying what happens and why)."""
    path = folder / CHECKPOINT_FILE
    refused = refuse_resume(folder, params, path)
    if refused:
        return None, refused
    payload = torch.load(path, map_location="cpu", weights_only=True)
    state = LoopState(**json.loads(payload["state"]))
    return payload, f"resuming from {path} at epoch {state.epoch + 1}, optimizer step {state.step}"


def refuse_resume(folder: Path, params: Params, path: Path) -> str | None:
    """Why the checkpoint at `path` (in `folder`, beside its params) cannot resume a run with `params`, as the sentence
    saying it starts fresh; None when it can."""
    if not path.is_file():
        return "no checkpoint: starting fresh"
    try:
        saved = json.loads((folder / PARAMS_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return f"checkpoint in {folder} has no readable params: starting fresh"
    current = _training_params(params)
    changed = sorted(k for k in current.keys() | saved.keys() if current.get(k) != saved.get(k))
    if changed:
        detail = ", ".join(f"{k}: {saved.get(k)!r} -> {current.get(k)!r}" for k in changed[:5])
        return f"checkpoint in {folder} was made with different params ({detail}): starting fresh"
    return None


def write_params(folder: Path, params: Params) -> None:
    """Record beside a checkpoint the training params it was made with (`refuse_resume` compares them)."""
    (folder / PARAMS_FILE).write_text(json.dumps(_training_params(params), indent=2, sort_keys=True), encoding="utf-8")


def restore(payload: dict[str, Any], step: TrainStep, scheduler: Any) -> LoopState:
    """Load a checkpoint payload into the step's model, optimizer and scaler and the schedule; return the loop state
    to continue from."""
    step.model.load_state_dict(payload["model"])
    step.optimizer.load_state_dict(payload["optimizer"])
    scheduler.load_state_dict(payload["scheduler"])
    step.scaler.load_state_dict(payload["scaler"])
    set_rng_state({"cpu": payload["rng_cpu"], "cuda": payload["rng_cuda"]})
    return LoopState(**json.loads(payload["state"]))


def rng_state() -> dict[str, Any]:
    """torch's RNG states, which dropout draws from: the CPU's and every CUDA device's (none without CUDA)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(saved: dict[str, Any]) -> None:
    """Put back what `rng_state` returned."""
    torch.set_rng_state(saved["cpu"])
    if saved["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda"])


@dataclass(frozen=True)
class CheckpointFormat:
    """How a run's checkpoints are written and read back: one file (`WHOLE`, a single process), or each rank's part
    (`pipelines.train.distributed_checkpoint.DISTRIBUTED`, DDP and FSDP)."""

    save: Callable[[Path, Params, LoopState, TrainStep, Any], None]
    find: Callable[[Path, Params], tuple[dict[str, Any] | None, str]]
    restore: Callable[[dict[str, Any], TrainStep, Any], LoopState]
    every_rank_writes: bool


WHOLE = CheckpointFormat(save_checkpoint, find_resumable, restore, every_rank_writes=False)


def discard(folder: Path) -> None:
    """Remove a finished run's checkpoints (a later run with the same params must train, not skip).

    Call it only on a folder this run claimed (`claim_checkpoint_dir`): it is nobody else's.
    """
    shutil.rmtree(folder, ignore_errors=True)
