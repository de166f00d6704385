"""The compile cache, as a run meets it: one compile for every padded width, the fingerprint's hit and miss predicted
right both ways (and the lr not part of it), warm with dropout on in a fresh process, a Mega-Cache blob loaded into an
empty cache, no manifest entry where the compile left nothing in the caches and a blob rewritten where it missed, the
optimizer's state alive when the step is warmed (on CUDA: recorded), and packed trials' processes writing one
fingerprint at once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import pipelines.train.compile_warmup as compile_warmup
from pipelines.train.compile_cache import BLOBS, CompileCache
from pipelines.train.compile_decision import CompilePrediction
from pipelines.train.engine import TrainRequest, TrainResult, train_model
from tests.conftest import REPO_ROOT, tiny_params
from tests.pipelines.train.helpers import tiny_model, tiny_split

CPU = torch.device("cpu")
# Any prediction: the test reads which case (cold, warm) the run assumed, not the seconds.
PREDICTION = CompilePrediction(eager_step_s=0.05, compiled_step_s=0.03, compile_s=30.0, warm_compile_s=5.0,
                               blob_compile_s=20.0, shape_s=0.05)  # fmt: skip


def compiled_run(default_params: Any, cache: Path, dropout: float = 0.0, lr: float = 3e-3) -> TrainResult:
    """One bucketed epoch (160 rows of 4-39 tokens, batch 16: every batch full), compiled, in `cache`."""
    params = tiny_params(default_params, epochs=1, batch_size=16, lr=lr, log_every_n_steps=1, warmup_ratio=0.0,
                         compile=True, precision="fp32")  # fmt: skip
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
        return train_model(
            TrainRequest(
                tiny_model(dropout=dropout),
                tiny_split(rows=160, seed=3),
                None,
                params,
                pad_id=0,
                device=CPU,
                precision="fp32",
                compile_prediction=PREDICTION,
                say=lambda _: None,
            )
        )


# Another process's Mega-Cache blob: a real one, of other graphs (a blob of this process would hold every graph it
# compiled so far, torch's Mega-Cache accumulating them).
FOREIGN = textwrap.dedent(
    """
    import sys, torch
    step = torch.compile(lambda x: (x * 2).sin())
    step(torch.randn(8))
    open(sys.argv[1], "wb").write(torch.compiler.save_cache_artifacts()[0])
    """
)


def foreign_blob(folder: Path) -> bytes:
    """The blob of a process that compiled other graphs, in `folder`."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor")}
    made = subprocess.run([sys.executable, "-c", FOREIGN, str(folder / "foreign.bin")], env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    return (folder / "foreign.bin").read_bytes()


@pytest.fixture(scope="module")
def runs(default_params, tmp_path_factory) -> dict[str, Any]:
    """Cold in an empty cache (its warm-up watched), the same again (warm), the lr changed (warm), dropout changed
    (cold), the first run's blob alone in a fresh folder, a run with Inductor's caches off, and the first run again
    in a folder whose blob of its fingerprint holds other graphs (another process's)."""
    cache = tmp_path_factory.mktemp("inductor")
    watched: list[dict[str, int]] = []
    real_warm = compile_warmup.warm

    def watching_warm(step, batches, units):
        trained = [p for p in step.model.parameters() if p.requires_grad]
        watched.append({"trained": len(trained), "with_state": sum(1 for p in trained if "exp_avg" in
                                                                    step.optimizer.state.get(p, {}))})  # fmt: skip
        real_warm(step, batches, units)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_warmup, "warm", watching_warm)
        cold = compiled_run(default_params, cache)
    out = {"cold": cold, "watched": watched, "cache": cache}
    out["warm"] = compiled_run(default_params, cache)
    out["other_lr"] = compiled_run(default_params, cache, lr=1e-2)
    out["other_dropout"] = compiled_run(default_params, cache, dropout=0.1)
    fresh = tmp_path_factory.mktemp("fresh")
    (fresh / BLOBS).mkdir()
    key = cold.notes["compile.fingerprint"]
    shutil.copyfile(CompileCache(cache).blob(key), fresh / BLOBS / f"{key}.bin")
    out["fresh_holds"] = CompileCache(fresh).holds(key)
    out["blob"] = compiled_run(default_params, fresh)
    # Caches off (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1 does the same): the graphs compile and are kept nowhere. The
    # process has saved artifacts before, so torch still hands back a blob (of the earlier runs' graphs).
    with torch._inductor.config.patch(force_disable_caches=True):
        out["uncached"] = compiled_run(default_params, cache, dropout=0.2)
    stale = tmp_path_factory.mktemp("stale")
    (stale / BLOBS).mkdir()
    planted = foreign_blob(tmp_path_factory.mktemp("foreign"))
    (stale / BLOBS / f"{key}.bin").write_bytes(planted)
    out["stale_holds"], out["stale"] = CompileCache(stale).holds(key), compiled_run(default_params, stale)
    out["stale_cache"], out["stale_planted"] = stale, planted
    return out


def test_a_bucketed_epoch_compiles_once_and_warms_every_width(runs):
    cold = runs["cold"]
    widths = cold.notes["pad_widths.resolved"].split(",")
    m = cold.metrics
    # The run's batches come in 3 or more widths; each was warmed (on CUDA: recorded) before the clocks, and all of
    # them share one compiled graph (a dynamic width), not one graph per width.
    assert 3 <= m["compile_shapes"] <= len(widths), (m["compile_shapes"], widths)
    assert m["compile_graphs"] == 1, m
    assert m["compile_graphs_in_loop"] == 0


def test_the_fingerprints_hit_and_miss_are_predicted_right_both_ways(runs):
    cold, warm = runs["cold"], runs["warm"]
    assert cold.notes["compile.resolved"].endswith(", cold)")
    assert cold.metrics["compile_cache_misses"] > 0 and cold.metrics["compile_cache_hits"] == 0
    assert cold.metrics["predicted_compile_time_s"] == pytest.approx(30.0 + 0.05 * cold.metrics["compile_shapes"])
    assert CompileCache(runs["cache"]).holds(cold.notes["compile.fingerprint"]) == "cache"
    # The same run again: predicted warm, and every graph came from the cache.
    assert warm.notes["compile.resolved"].endswith(", warm (from the cache))")
    assert warm.metrics["compile_cache_hits"] > 0 and warm.metrics["compile_cache_misses"] == 0
    # The lr lives in the optimizer, outside the graph: same fingerprint, predicted warm, all hits.
    other_lr = runs["other_lr"]
    assert other_lr.notes["compile.fingerprint"] == cold.notes["compile.fingerprint"]
    assert other_lr.notes["compile.resolved"].endswith("warm (from the cache))")
    assert other_lr.metrics["compile_cache_misses"] == 0
    # Dropout's p is baked into the graph: a new fingerprint, predicted cold, and Inductor compiled anew.
    other = runs["other_dropout"]
    assert other.notes["compile.fingerprint"] != cold.notes["compile.fingerprint"]
    assert other.notes["compile.resolved"].endswith(", cold)")
    assert other.metrics["compile_cache_misses"] > 0


def test_warm_with_dropout_on_as_trials_run_in_a_fresh_process(runs, default_params):
    # Trials keep dropout on, with fast_dropout's default (true; a compiled step draws Inductor's own masks). The
    # dropout run compiled cold into the cache; a fresh interpreter compiling it again must predict warm and find
    # every graph there: Dynamo's and Inductor's in-memory caches start empty, as a trial's do.
    assert default_params.fast_dropout is True
    other = runs["other_dropout"]
    rerun = subprocess.run(
        [sys.executable, "-c", DROPOUT_RERUN, str(runs["cache"])],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    warm = json.loads(rerun.stdout.splitlines()[-1])
    assert warm["notes"]["compile.fingerprint"] == other.notes["compile.fingerprint"]
    assert warm["notes"]["compile.resolved"].endswith(", warm (from the cache))")
    assert warm["notes"]["fast_dropout"] == "off"
    assert warm["metrics"]["compile_cache_hits"] > 0 and warm["metrics"]["compile_cache_misses"] == 0, warm["metrics"]


# The dropout run of `runs`, compiled again in a fresh interpreter against the same cache folder.
DROPOUT_RERUN = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pipelines.params import load_params
    from tests.conftest import REPO_ROOT
    from tests.pipelines.train.test_compile_cache import compiled_run

    run = compiled_run(load_params(REPO_ROOT / "params.yaml"), Path(sys.argv[1]), dropout=0.1)
    print(json.dumps({"metrics": run.metrics, "notes": run.notes}))
    """
)


def test_no_manifest_entry_or_blob_where_the_compile_left_nothing_in_the_caches(runs):
    uncached = runs["uncached"]
    key = uncached.notes["compile.fingerprint"]
    # Nothing went through Inductor's caches: the next compile of this fingerprint compiles cold again.
    assert uncached.metrics["compile_cache_hits"] == 0 and uncached.metrics["compile_cache_misses"] == 0
    assert "compile.blob" not in uncached.notes
    assert key not in CompileCache(runs["cache"]).manifest()
    assert CompileCache(runs["cache"]).holds(key) is None


def test_a_compile_that_missed_rewrites_the_blob_that_did_not_hold_its_graphs(runs):
    # The folder's blob of the run's fingerprint holds other graphs (a blob from another build, or a key that once
    # lied): predicted warm from it, Inductor missed and compiled cold.
    stale, cache = runs["stale"], CompileCache(runs["stale_cache"])
    key = stale.notes["compile.fingerprint"]
    assert runs["stale_holds"] == "blob" and stale.metrics["compile_blob_loaded"] == 1
    assert stale.metrics["compile_cache_misses"] > 0
    # The cold compile filled this folder's caches (warm here now), and the blob is this compile's, not the one that
    # missed: kept, every fresh folder loading it would be predicted warm and compile cold.
    assert cache.holds(key) == "cache"
    assert stale.notes["compile.blob"] == str(cache.blob(key))
    assert cache.blob(key).read_bytes() != runs["stale_planted"]


def test_a_blob_alone_fills_an_empty_cache(runs):
    assert runs["fresh_holds"] == "blob"
    blob = runs["blob"]
    assert blob.notes["compile.resolved"].endswith("warm (from the blob))")
    assert blob.metrics["compile_blob_loaded"] == 1
    assert blob.metrics["compile_cache_hits"] > 0 and blob.metrics["compile_cache_misses"] == 0


def test_the_optimizer_state_exists_when_the_step_is_warmed(runs):
    # On CUDA the warm-up records the graphs, the allocator's last look at the step: the state must be alive then.
    (watched,) = runs["watched"]
    assert watched["trained"] > 0 and watched["with_state"] == watched["trained"], watched
    assert runs["cold"].notes["compile.state_before_recording"] == "true"


WRITERS, ROUNDS, SHARED = 8, 50, "shared0fingerprint00"
# Packed trials' processes: a fresh interpreter imports the cache once (8 imports of torch would take most of the
# test's time on busy cores) and forks the writers, which touch no torch; they pass a barrier together, then each
# writes the shared fingerprint's blob and manifest entries ROUNDS times. A writer's payload is its own bytes, so a
# torn or mixed blob matches no writer's; the launcher prints the writers' exit codes.
RACE = textwrap.dedent(
    """
    import json, multiprocessing, sys
    from pathlib import Path
    from pipelines.train.compile_cache import CompileCache

    folder, writers, rounds, shared = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    def write(writer, barrier):
        cache, payload = CompileCache(folder), (f"writer {writer:02d} " * 16384).encode()
        barrier.wait(timeout=60)
        for n in range(rounds):
            cache.write_blob(shared, payload)
            cache.add_entry(f"writer-{writer}-round-{n}", {"writer": writer, "round": n})
            cache.add_entry(shared, {"writer": writer, "round": n})

    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(writers)
    racers = [context.Process(target=write, args=(w, barrier)) for w in range(writers)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(timeout=120)
    print(json.dumps([racer.exitcode for racer in racers]))
    """
)


def test_packed_trials_writing_one_fingerprint_at_once_lose_nothing(tmp_path):
    race = subprocess.run(
        [sys.executable, "-c", RACE, str(tmp_path), str(WRITERS), str(ROUNDS), SHARED],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    # A writer that raised (a rename whose file another took away) exits 1 with its traceback on stderr.
    assert race.returncode == 0, race.stderr[-3000:]
    assert json.loads(race.stdout.splitlines()[-1]) == [0] * WRITERS, race.stderr[-3000:]

    cache = CompileCache(tmp_path)
    payloads = {(f"writer {w:02d} " * 16384).encode() for w in range(WRITERS)}
    assert cache.blob(SHARED).read_bytes() in payloads
    assert sorted(p.name for p in (tmp_path / BLOBS).iterdir()) == [f"{SHARED}.bin"]
    manifest = json.loads(cache.manifest_path.read_text())
    expected = {SHARED} | {f"writer-{w}-round-{n}" for w in range(WRITERS) for n in range(ROUNDS)}
    assert set(manifest) == expected, (len(expected - set(manifest)), "entries lost")
    assert manifest[SHARED]["round"] == ROUNDS - 1 and manifest[SHARED]["writer"] in range(WRITERS)
    assert cache.holds(SHARED) == "cache"
