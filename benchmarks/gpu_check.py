"""Every GPU check in one command: the GPU tests, the mission on CUDA, the packed grid, BERT-base against the HF
Trainer, the 1.1B Llama's MFU and the compiled peak, each step under its own deadline.

    python -m benchmarks.gpu_check --plan              # the steps, their budgets, and how they fill device calls
    python -m benchmarks.gpu_check                     # on a machine with a CUDA GPU and the project installed
    python -m benchmarks.gpu_check --steps gpu_tests mission grid peak    # one device call's share (see --plan)
    python -m benchmarks.gpu_check --smoke             # the same steps on this CPU at toy sizes (the test suite's)

Steps run in order, each in its own processes, killed at its deadline (its budget, from the start of the step). Each
step's result is written as it comes, to `--out` (default `gpu_check_out/`): `gpu_check.json` (every step: status,
seconds, budget, the error's last lines, its figures; then the targets) and `gpu_check.md` (the same as tables).
A step that fails or runs out of time is recorded with its error and the next one runs; the command exits non-zero
when any step did not pass. The targets (issue 60's) are judged only on a GPU: a smoke run's figures are the CPU's
and say nothing of a card; there each target reads 'smoke'.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT
from benchmarks.gpu_check_report import markdown, step_figures, targets

CALL_S = 600  # a device call's limit
DEVICE_S = 900  # device time lent to a session, the machine's 2-4 minute start included
CALL_MARGIN_S = 30  # per call: the copy's start, imports, writing results
BERT_ROWS = 24_000  # a fifth of AG News' 120k-row epoch: what fits a call with the Trainer cold and warm (see --plan)
BERT_ONLY = ["ours defaults", "trainer eager", "trainer torch_compile"]


@dataclass(frozen=True)
class Context:
    """Where a run writes, whether it is the smoke run, and the pre-tokenized AG News rows the BERT steps read."""

    out: Path
    smoke: bool
    data: Path

    def bench(self, part: str, *extra: str) -> list[str]:
        """A `bench_gpu_parts` command writing its JSON under `out` (`--json` is the last pair of `extra`)."""
        smoke = ["--smoke"] if self.smoke else []
        return [sys.executable, "-m", "benchmarks.bench_gpu_parts", "--part", part, "--rounds", "1",
                "--data", str(self.data), *smoke, *extra]  # fmt: skip

    def cache(self, name: str) -> dict[str, str]:
        """An Inductor cache folder of this run's own (fresh at its first use: a cold compile)."""
        return {"TORCHINDUCTOR_CACHE_DIR": str(self.out / "inductor" / name)}


Command = tuple[list[str], dict[str, str]]


@dataclass(frozen=True)
class Step:
    """One check: its commands (run in order under one deadline) and its budgets, on a GPU and in smoke mode."""

    name: str
    what: str
    budget_s: int
    smoke_budget_s: int
    call: int
    commands: Callable[[Context], list[Command]]

    def budget(self, smoke: bool) -> int:
        return self.smoke_budget_s if smoke else self.budget_s


def _steps_module(step: str) -> Callable[[Context], list[Command]]:
    return lambda c: [([sys.executable, "-m", "benchmarks.gpu_check_steps", step, "--out", str(c.out)]
                       + (["--smoke"] if c.smoke else []), {})]  # fmt: skip


def _gpu_tests(c: Context) -> list[Command]:
    # addopts cleared: no xdist or timeout plugin needed on the GPU host; one process, as the CUDA tests expect.
    return [([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-q", "-o", "addopts=", "-p",
              "no:cacheprovider", f"--junitxml={c.out / 'gpu_tests.xml'}"], {})]  # fmt: skip


def _bert(c: Context) -> list[Command]:
    rows = ["--rows", "64" if c.smoke else str(BERT_ROWS)]
    return [(c.bench("bert", *rows, "--only", *BERT_ONLY, "--json", str(c.out / f"bert_{case}.json")),
             c.cache("bert")) for case in ("cold", "warm")]  # fmt: skip


def _llama(c: Context) -> list[Command]:
    return [(c.bench("llama", "--only", "ours defaults", "--json", str(c.out / "llama.json")), c.cache("llama"))]


def _peak(c: Context) -> list[Command]:
    # `ours defaults` first, in a fresh cache: when `auto` says on, it compiles cold (the widths' compile time, the
    # prediction's check); `ours eager` then gives the same config's eager peak and step; `ours compiled` last.
    rows = ["--rows", "64" if c.smoke else "3200"]
    only = ["--only", "ours defaults", "ours eager", "ours compiled"]
    return [(c.bench("bert", *rows, *only, "--json", str(c.out / "peak.json")), c.cache("peak"))]


STEPS = [
    Step("gpu_tests", "pytest -m gpu tests/gpu (one process)", 100, 240, 1, _gpu_tests),
    Step("mission", "dvc repro at the defaults, dvc exp run -S optim=adafactor; each trial's run read", 160, 600, 1,
         _steps_module("mission")),
    Step("grid", "4 BERT-base variants packed on one card vs one at a time (the train stage, whole)", 180, 600, 1,
         _steps_module("grid")),
    Step("peak", "BERT-base 3,200 rows: auto cold, eager, compiled; peaks vs each other and the floor", 130, 300, 1,
         _peak),
    Step("bert", f"BERT-base {BERT_ROWS:,} AG News rows, whole run: ours vs the Trainer eager and compiled, cold "
         "then warm", 420, 300, 2, _bert),
    Step("llama", "1.1B Llama at the defaults: MFU, step, compile (cold)", 120, 300, 2, _llama),
]  # fmt: skip


def plan_lines(steps: list[Step], smoke: bool) -> tuple[list[str], bool]:
    """The plan as printed lines, and whether every device call's steps fit its limit."""
    lines, fits = [f"{'step':<10} {'call':>4} {'budget s':>9}  what"], True
    for step in steps:
        lines.append(f"{step.name:<10} {step.call:>4} {step.budget(smoke):>9}  {step.what}")
    total = sum(s.budget(smoke) for s in steps)
    lines.append(f"{'total':<10} {'':>4} {total:>9}")
    if smoke:  # on this CPU: no device call to fit
        return lines, True
    for call in sorted({s.call for s in steps}):
        used = sum(s.budget(smoke) for s in steps if s.call == call) + CALL_MARGIN_S
        fits &= used <= CALL_S
        names = " ".join(s.name for s in steps if s.call == call)
        lines.append(f"device call {call}: {used} s of {CALL_S} (steps + {CALL_MARGIN_S} s margin): "
                     f"python -m benchmarks.gpu_check --steps {names}")  # fmt: skip
    lines.append("install first (benchmarks/gpu_runner.py: pack here, receive each part there, install there)")
    lines.append(f"budgets are deadlines; a loan of {DEVICE_S} s of device time, the machine's start included, may "
                 "hold call 1 only: run call 2 on the next loan")  # fmt: skip
    return lines, fits


def run_step(step: Step, context: Context) -> dict[str, Any]:
    """Run `step`'s commands under its deadline; its record (status passed / failed / timed out, seconds, error)."""
    deadline, start = time.monotonic() + step.budget(context.smoke), time.monotonic()
    log = context.out / f"{step.name}.log"
    record: dict[str, Any] = {"name": step.name, "what": step.what, "budget_s": step.budget(context.smoke)}
    with log.open("w") as sink:
        for argv, env in step.commands(context):
            sink.write(f"$ {' '.join(argv)}\n")
            sink.flush()
            status, error = _run_until(argv, env, deadline, sink)
            if status != "passed":
                record.update(status=status, error=error or _tail(log))
                break
        else:
            record["status"] = "passed"
    record["seconds"] = round(time.monotonic() - start, 1)
    return record


def _run_until(argv: list[str], env: dict[str, str], deadline: float, sink: Any) -> tuple[str, str | None]:
    """One command, its output to `sink`, killed with its process group at `deadline`."""
    proc = subprocess.Popen(argv, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=sink, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return "timed out", f"`{' '.join(argv[2:4])}` still running at the step's deadline"
    return ("passed", None) if code == 0 else ("failed", None)


def _tail(log: Path, lines: int = 12) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def host() -> dict[str, Any]:
    """The machine the figures come from: its card (or CPU), torch, driver where known."""
    import torch

    found: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                             "cpus": os.cpu_count(), "machine": platform.machine()}  # fmt: skip
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        found |= {"card": properties.name, "card_mib": properties.total_memory // 2**20, "cuda": torch.version.cuda}
    return found


def write_results(context: Context, results: dict[str, Any]) -> None:
    """The JSON and the markdown, rewritten whole after every step."""
    (context.out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (context.out / "gpu_check.md").write_text(markdown(results) + "\n")


def check(steps: list[Step], context: Context) -> dict[str, Any]:
    """Run `steps` in order; the results as written."""
    context.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"mode": "smoke" if context.smoke else "gpu", "host": host(),
                               "started": datetime.now(UTC).isoformat(timespec="seconds"), "steps": []}  # fmt: skip
    write_results(context, results)
    for step in steps:
        print(f"gpu_check: {step.name} (deadline {step.budget(context.smoke)} s): {step.what}", flush=True)
        record = run_step(step, context)
        record["figures"] = step_figures(step.name, context.out)
        results["steps"].append(record)
        results["targets"] = targets(results)
        write_results(context, results)
        print(f"gpu_check: {step.name} {record['status']} in {record['seconds']} s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--plan", action="store_true", help="print the steps, budgets and device calls; run nothing")
    parser.add_argument("--smoke", action="store_true", help="the same steps on this CPU at toy sizes")
    parser.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], help="only these steps, in order")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "gpu_check_out", help="where results are written")
    parser.add_argument("--data", type=Path, help="pre-tokenized AG News (default .bench_gpu/; smoke: generated)")
    args = parser.parse_args()
    steps = [s for s in STEPS if not args.steps or s.name in args.steps]
    if args.plan:
        lines, fits = plan_lines(steps, args.smoke)
        print("\n".join(lines))
        sys.exit(0 if fits else "gpu_check: the plan does not fit its device calls")
    out = args.out.resolve()
    data = args.data or (out / "smoke_data" if args.smoke else REPO_ROOT / ".bench_gpu")
    if args.smoke and args.data is None:
        from benchmarks.gpu_check_steps import smoke_data

        smoke_data(data)
    if not (data / "meta.json").is_file() and any(s.name in ("bert", "peak") for s in steps):
        sys.exit(f"gpu_check: no pre-tokenized AG News at {data}: run `python -m benchmarks.bench_gpu prepare` here "
                 "and carry .bench_gpu/ (benchmarks/gpu_runner.py packs it)")  # fmt: skip
    results = check(steps, Context(out, args.smoke, data))
    failed = [s["name"] for s in results["steps"] if s["status"] != "passed"]
    print(markdown(results))
    if failed:
        sys.exit(f"gpu_check: {len(failed)} step(s) did not pass: {', '.join(failed)} (see {out}/gpu_check.md)")


if __name__ == "__main__":
    main()
