"""What an experiment costs beyond its training: the default `dvc exp run -S optim=adafactor` against a plain script.

    python -m benchmarks.bench_fixed_cost [--repeats R] [--json PATH] [--smoke]

In a fresh copy of the project (its own git repo), `dvc repro` runs once at the defaults (so tokenize is cached, as
it is for a user's second experiment). Then, R times and alternating which goes first: the pipeline's
`dvc exp run -S optim=adafactor` (the workspace reset to the baseline and DVC's run cache emptied before each, so
train, evaluate and report really run), and `benchmarks.plain_train` (the same model, arrays, optimizer, schedule,
bucketing and epochs, scoring validation and test, as one plain process). Each is timed as a whole process; the
pipeline's output is timestamped line by line, so its time splits by stage (DVC's own start and end, and each
stage from its `Running stage` line to the next). Prints the split, the medians and the ratio (pipeline / plain).
A third side, `pipeline, Ray head running`, runs the same experiment joined to a local Ray head started once before
the rounds (`ray start --head`, `RAY_ADDRESS`: what a user comparing many experiments can do,
docs/how-to/ray-cluster.md), so the cost of starting and stopping Ray with every experiment is measured, not guessed.
The default sides run with RAY_ADDRESS unset, whatever the caller's environment says.
`--smoke`: one round on 300 generated rows and one epoch (the test suite runs it, so it cannot rot).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT

STAGE_LINE = re.compile(r"Running stage '([\w-]+)'")


def project_copy(dest: Path) -> Path:
    """This project's tracked and unignored files, committed in a new git repo at `dest`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout  # fmt: skip
    for rel in filter(None, listed.split("\0")):
        if (REPO_ROOT / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO_ROOT / rel, dest / rel)
    for command in (["git", "init", "-q", "-b", "main"], ["git", "add", "-A"], ["git", "commit", "-qm", "copy"]):
        subprocess.run(command, cwd=dest, check=True, env=git_env())
    return dest


def git_env() -> dict[str, str]:
    return {**os.environ, "GIT_AUTHOR_NAME": "bench", "GIT_AUTHOR_EMAIL": "bench@example.com",
            "GIT_COMMITTER_NAME": "bench", "GIT_COMMITTER_EMAIL": "bench@example.com", "DVC_NO_ANALYTICS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}  # fmt: skip


def timed_lines(command: list[str], cwd: Path, ray_address: str = "") -> tuple[float, list[tuple[float, str]]]:
    """Run `command` (joined to the Ray head at `ray_address`, else with RAY_ADDRESS unset); its wall time and each
    output line with the seconds since the start at which it came."""
    env = {k: v for k, v in git_env().items() if k != "RAY_ADDRESS"}
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1)  # fmt: skip
    assert proc.stdout is not None
    lines = [(time.perf_counter() - start, line.rstrip("\n")) for line in proc.stdout]
    code = proc.wait()
    wall = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"{' '.join(command)} exited {code}:\n" + "\n".join(text for _, text in lines[-40:]))
    return wall, lines


@contextlib.contextmanager
def running_ray_head(cwd: Path) -> Iterator[str]:
    """A local Ray head as a user starts one for many experiments (`ray start --head`, dashboard off, with a token
    where the machine has none: see tests/conftest.py), in a session of its own; its address. Stopped afterwards by
    its session, never `ray stop` (which would stop every Ray on the machine)."""
    ray_cli = str(Path(sys.executable).parent / "ray")
    subprocess.run([ray_cli, "get-auth-token", "--generate"], env=git_env(), capture_output=True, timeout=60)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    head = subprocess.Popen([ray_cli, "start", "--head", "--node-ip-address=127.0.0.1", f"--port={port}",
                             f"--num-cpus={os.cpu_count()}", "--include-dashboard=false", "--disable-usage-stats"],
                            cwd=cwd, env=git_env(), start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    printed = head.communicate(timeout=120)[0]
    try:
        if head.returncode != 0:
            raise SystemExit(f"`ray start --head` failed:\n{printed}")
        yield f"127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)


def stage_split(wall: float, lines: list[tuple[float, str]]) -> dict[str, float]:
    """Seconds per stage (from its `Running stage` line to the next stage's, or to the last stage's final output
    line), DVC's start before the first stage, and DVC's end after the last stage's output."""
    marks = [(t, m.group(1)) for t, text in lines if (m := STAGE_LINE.search(text))]
    if not marks:
        return {"dvc (no stage ran)": wall}
    split = {"dvc start": marks[0][0]}
    ends = [t for t, _ in marks[1:]] + [max(t for t, text in lines if not text.startswith("Ran experiment"))]
    for (start, name), end in zip(marks, ends, strict=True):
        split[name] = end - start
    split["dvc end"] = wall - ends[-1]
    return split


def set_params(path: Path, overrides: dict[str, Any]) -> None:
    """Dotted-key overrides written into a params.yaml (what `dvc exp run -S` does)."""
    import yaml

    from pipelines.params import set_dotted

    tree = yaml.safe_load(path.read_text())
    for key, value in overrides.items():
        set_dotted(tree, key, value)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))


def reset_to_baseline(root: Path) -> None:
    """The workspace as the baseline commit has it, its outputs checked out, and no run cache to skip train with."""
    subprocess.run(["git", "checkout", "-q", "--", "."], cwd=root, check=True, env=git_env())
    subprocess.run(["dvc", "checkout", "-q", "--force"], cwd=root, check=True, env=git_env())
    shutil.rmtree(root / ".dvc" / "cache" / "runs", ignore_errors=True)


def host() -> dict[str, Any]:
    flags = ""
    if Path("/proc/cpuinfo").is_file():
        line = next((x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags")), "")
        flags = " ".join(f for f in line.split() if f.startswith(("avx", "amx")))
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "flags": flags,
            "load_1m_before": os.getloadavg()[0]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        root = project_copy(Path(tmp) / "project")
        if args.smoke:
            set_params(root / "params.yaml", {"data.generator.num_rows": 300, "epochs": 1})
        repro_s, _ = timed_lines(["dvc", "repro", "-q"], root)  # a fresh clone's first run: the README's figure
        print(f"dvc repro on the defaults (tokenize included): {repro_s:.1f} s", flush=True)
        for command in (["git", "add", "-A"], ["git", "commit", "-qm", "baseline"]):
            subprocess.run(command, cwd=root, check=True, env=git_env())
        with running_ray_head(Path(tmp)) as address:
            rounds = [one_round(root, r, address) for r in range(repeats)]
    report = summary(rounds, args) | {"first_repro_s": repro_s}
    print(render(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


SIDES = ("pipeline", "plain", "head")  # the default experiment, the plain script, the experiment on a running head


def one_round(root: Path, index: int, ray_address: str) -> dict[str, Any]:
    """Each side once, the order rotated by round (round-robin, so none always runs first on a cold cache)."""
    result: dict[str, Any] = {}
    for side in SIDES[index % 3 :] + SIDES[: index % 3]:
        if side == "plain":
            wall, lines = timed_lines([sys.executable, "-m", "benchmarks.plain_train", "--root", str(root)], REPO_ROOT)
            result["plain_s"], result["plain"] = wall, json.loads(lines[-1][1])
            continue
        reset_to_baseline(root)
        address = ray_address if side == "head" else ""
        wall, lines = timed_lines(["dvc", "exp", "run", "-S", "optim=adafactor"], root, address)
        result[f"{side}_s"], result[f"{side}_split"] = wall, stage_split(wall, lines)
    result["split"] = result.pop("pipeline_split")
    print(f"round {index + 1}: pipeline {result['pipeline_s']:.1f} s, on a running Ray head {result['head_s']:.1f} s, "
          f"plain {result['plain_s']:.1f} s", flush=True)  # fmt: skip
    return result


def summary(rounds: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    stages = list(dict.fromkeys(k for r in rounds for k in r["split"]))
    pipeline, plain, head = (statistics.median(r[k] for r in rounds) for k in ("pipeline_s", "plain_s", "head_s"))
    split = {s: statistics.median(r["split"].get(s, 0.0) for r in rounds) for s in stages}
    head_split = {s: statistics.median(r["head_split"].get(s, 0.0) for r in rounds) for s in stages}
    return {"command": "python -m benchmarks.bench_fixed_cost " + " ".join(sys.argv[1:]), "host": host(),
            "rounds": rounds, "pipeline_median_s": pipeline, "plain_median_s": plain, "ratio": pipeline / plain,
            "split_median_s": split, "head_median_s": head, "head_ratio": head / plain,
            "head_split_median_s": head_split}  # fmt: skip


def render(report: dict[str, Any]) -> str:
    lines = ["| Part of `dvc exp run -S optim=adafactor` | Seconds (median) | With a Ray head running |",
             "|---|---|---|"]  # fmt: skip
    head = report["head_split_median_s"]
    lines += [f"| {name} | {seconds:.1f} | {head[name]:.1f} |" for name, seconds in report["split_median_s"].items()]
    lines += [f"| **pipeline, whole** | **{report['pipeline_median_s']:.1f}** | **{report['head_median_s']:.1f}** |",
              f"| plain script, whole (`benchmarks.plain_train`) | {report['plain_median_s']:.1f} | |",
              f"| **ratio** | **{report['ratio']:.2f}x** | **{report['head_ratio']:.2f}x** |"]  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    main()
