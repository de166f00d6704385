"""What `benchmarks.gpu_check` reads back from each step's files, the targets it judges them by, and its tables.

Whole-run ratios are of `call_s`, the seconds `bench_gpu_parts` took for a configuration from building its model to
its last step: compile, warm-up and data included, as a user's run pays them. Step times and MFU are the engine's
own (timed steps). The targets are issue 60's; on a smoke run (the CPU) none is judged.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any


def _json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def configurations(path: Path) -> dict[str, dict[str, Any]]:
    """A `bench_gpu_parts` JSON's first round of each configuration that ran (errors and skips left out)."""
    runs = _json(path).get("runs", {})
    return {name: rounds[0] for name, rounds in runs.items() if rounds and "error" not in rounds[0]}


def _ratio(slow: dict[str, Any] | None, fast: dict[str, Any] | None) -> float | None:
    if not slow or not fast or not fast.get("call_s"):
        return None
    return slow["call_s"] / fast["call_s"]


def _junit(path: Path) -> dict[str, Any]:
    try:
        suite = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return {}
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    return counts | ({"passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]}
                     if counts else {})  # fmt: skip


def step_figures(name: str, out: Path) -> dict[str, Any]:
    """The figures `name` left in `out` (empty when it wrote none)."""
    if name == "gpu_tests":
        return _junit(out / "gpu_tests.xml")
    if name in ("mission", "grid"):
        return _json(out / f"{name}.json")
    if name == "bert":
        figures: dict[str, Any] = {}
        for case in ("cold", "warm"):
            ran = configurations(out / f"bert_{case}.json")
            ours = ran.get("ours defaults")
            figures[case] = {
                "configurations": ran,
                "vs_trainer_eager": _ratio(ran.get("trainer eager"), ours),
                "vs_trainer_compiled": _ratio(ran.get("trainer torch_compile"), ours),
            }
        return figures
    if name == "llama":
        return configurations(out / "llama.json")
    if name == "peak":
        return configurations(out / "peak.json")
    return {}


def _figures(results: dict[str, Any], step: str) -> dict[str, Any]:
    return next((s.get("figures", {}) for s in results.get("steps", []) if s["name"] == step), {})


def _target(what: str, measured: float | None, met: bool | None, unit: str = "") -> dict[str, Any]:
    shown = None if measured is None else f"{measured:,.3g}{unit}"
    return {"target": what, "measured": shown, "met": met}


def _at_least(what: str, value: float | None, floor: float, unit: str = "x") -> dict[str, Any]:
    return _target(what, value, None if value is None else value >= floor, unit)


def _peak_targets(peak: dict[str, Any]) -> list[dict[str, Any]]:
    """The compiled peak, compile time, the prediction and `auto`'s decision, at the peak step's one config."""
    defaults, eager, compiled = peak.get("ours defaults"), peak.get("ours eager"), peak.get("ours compiled")
    cold = defaults if defaults and str(defaults.get("compile_resolved", "")).startswith("on") else compiled
    found = []
    if cold:
        predicted, measured = cold.get("predicted_compile_time_s"), cold.get("compile_time_s")
        found.append(_target("BERT-base widths compiled cold <= 30 s", measured, None if measured is None else
                             measured <= 30, " s"))  # fmt: skip
        error = abs(predicted / measured - 1) if predicted and measured else None
        found.append(_target("predicted compile time within 50%", error, None if error is None else error <= 0.5))
        floor_ok = cold["peak_allocated_mb"] >= cold["static_floor_mb"]
        found.append(_target("compiled peak >= weights + gradients + state", cold["peak_allocated_mb"], floor_ok,
                             " MiB"))  # fmt: skip
        if eager:
            share = cold["peak_allocated_mb"] / eager["peak_allocated_mb"]
            found.append(_target("compiled peak / eager peak (same config) in [0.5, 1.3]", share, 0.5 <= share <= 1.3))
    if eager and eager.get("predicted_step_ms"):
        error = abs(eager["predicted_step_ms"] / eager["step_ms"] - 1)
        found.append(_target("predicted eager step within 25%", error, error <= 0.25))
    if defaults and eager and (compiled or cold is defaults):
        auto_on = str(defaults.get("compile_resolved", "")).startswith("on")
        right = defaults["call_s"] < eager["call_s"] if auto_on else compiled["call_s"] >= eager["call_s"]
        found.append(_target(f"compile: auto right (resolved {'on' if auto_on else 'off'})", None, right))
    return found


def targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Issue 60's targets against what the steps measured; `met` None where a figure is missing, 'smoke' on a CPU."""
    bert, llama, grid = _figures(results, "bert"), _figures(results, "llama"), _figures(results, "grid")
    cold, warm = bert.get("cold", {}), bert.get("warm", {})
    ours_llama = llama.get("ours defaults", {})
    found = [
        _at_least("BERT-base whole run vs Trainer eager, cold >= 2.0x", cold.get("vs_trainer_eager"), 2.0),
        _at_least("BERT-base whole run vs Trainer eager, warm >= 2.5x", warm.get("vs_trainer_eager"), 2.5),
        _at_least("ahead of Trainer torch_compile, cold > 1x", cold.get("vs_trainer_compiled"), 1.0 + 1e-9),
        _at_least("ahead of Trainer torch_compile, warm > 1x", warm.get("vs_trainer_compiled"), 1.0 + 1e-9),
        _at_least("1.1B MFU >= 45%", ours_llama.get("mfu"), 0.45, ""),
        _target("1.1B compile <= 15 s cold", ours_llama.get("compile_time_s"),
                None if not ours_llama.get("compile_time_s") else ours_llama["compile_time_s"] <= 15, " s"),
        *_peak_targets(_figures(results, "peak")),
        _at_least("packed grid vs one at a time >= 2.5x", grid.get("speedup"), 2.5),
    ]  # fmt: skip
    if results.get("mode") == "smoke":
        for target in found:
            target["met"] = "smoke"
    return found


def _summary(step: dict[str, Any]) -> str:
    """One line of a step's headline figures."""
    f, name = step.get("figures", {}), step["name"]
    if name == "gpu_tests" and f:
        return f"{f['passed']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"
    if name == "mission" and f.get("runs"):
        devices = sorted({str(r.get("device")) for r in f["runs"]})
        return f"{len(f['runs'])} trial runs on {', '.join(devices)}; repro {f.get('repro_s', 0):.0f} s"
    if name == "grid" and "speedup" in f:
        seconds = [f"{label} {f.get(label, {}).get('train_stage_s', 0):.0f} s" for label in ("packed", "one at a time")]
        return f"{', '.join(seconds)}: {f['speedup']:.2f}x"
    if name == "bert":
        ratios = [f"{case} {f[case]['vs_trainer_eager']:.2f}x" for case in ("cold", "warm")
                  if f.get(case, {}).get("vs_trainer_eager")]  # fmt: skip
        return "vs Trainer eager, whole run: " + ", ".join(ratios) if ratios else ""
    if name in ("llama", "peak"):
        return "; ".join(f"{k}: {v.get('step_ms', 0):.1f} ms/step" for k, v in f.items())
    return ""


def markdown(results: dict[str, Any]) -> str:
    """The steps and the targets as tables, then each failure's error."""
    hosted = ", ".join(f"{k} {v}" for k, v in results.get("host", {}).items())
    lines = [f"# gpu_check ({results.get('mode')}), {results.get('started')}", "", f"Host: {hosted}", "",
             "| step | status | seconds (budget) | figures |", "|---|---|---|---|"]  # fmt: skip
    for step in results.get("steps", []):
        lines.append(f"| {step['name']} | {step.get('status')} | {step.get('seconds')} ({step.get('budget_s')}) | "
                     f"{_summary(step)} |")  # fmt: skip
    lines += ["", "| target | measured | met |", "|---|---|---|"]
    for target in results.get("targets", []):
        met = {True: "yes", False: "**no**", None: "not measured"}.get(target["met"], target["met"])
        lines.append(f"| {target['target']} | {target['measured'] or '—'} | {met} |")
    for step in results.get("steps", []):
        if step.get("error"):
            lines += ["", f"## {step['name']}: {step.get('status')}", "", "```", step["error"], "```"]
    return "\n".join(lines)
