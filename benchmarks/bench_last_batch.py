"""A compiled step's short last batch, three ways, side by side in one process: rows padded to the batch and masked
(what a compiled run does, `pipelines.data.loader.pad_rows`), the row count marked dynamic, and today's static rows
(a graph of its own). Each variant is its own code object (its own Dynamo cache), compiled cold (Inductor's caches
off) twice in alternating order, then all steps timed in turn, round-robin, so the shared CPU's load falls on all
alike (issue 60).

    python -m benchmarks.bench_last_batch          # HIDDEN=128 ROUNDS=50 to match RESULTS.md
"""

# ruff: noqa: E401, E702, E731 - kept as measured
import os
import statistics
import tempfile
import time
import types

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-last-batch-"))
import torch
import torch._dynamo
import torch._inductor.config as ic
import torch.nn.functional as F
from torch._dynamo.utils import counters

from tests.pipelines.train.helpers import tiny_model

ic.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False
torch.set_num_threads(2)
ROWS, SHORT, HIDDEN = 16, 5, int(os.environ.get("HIDDEN", 64))


def batch(rows, width, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 100, (rows, width), generator=g)
    mask = torch.ones(rows, width, dtype=torch.long)
    mask[:, width * 3 // 4 :] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (rows,), generator=g)}


def padded(b, rows):
    n = b["input_ids"].shape[0]
    out = {k: torch.cat([v, v[:1].expand(rows - n, *v.shape[1:])]) for k, v in b.items()}
    out["labels"][n:] = -100
    return out


def template(model, b):
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    return F.cross_entropy(logits.float(), b["labels"], reduction="sum")


class Variant:
    def __init__(self, name, tag):
        self.name, self.model = name, tiny_model(layers=2, hidden=HIDDEN)
        code = template.__code__.replace(co_name=f"loss_{name.replace(' ', '_')}_{tag}")
        self.fn = torch.compile(types.FunctionType(code, template.__globals__), dynamic=None)
        self.times, self.short = [], []

    def step(self, b):
        if self.name == "padded rows" and b["input_ids"].shape[0] < ROWS:
            b = padded(b, ROWS)
        for t in b.values():
            if t.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(t, 1)
            if self.name == "dynamic rows":
                torch._dynamo.maybe_mark_dynamic(t, 0)
        g0 = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        self.fn(self.model, b).backward()
        self.model.zero_grad(set_to_none=True)
        spent = time.perf_counter() - start
        self.extra = getattr(self, "extra", 0) + counters["stats"]["unique_graphs"] - g0
        return spent

    def compile(self):
        g0 = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        for b in (batch(ROWS, 32, 1), batch(ROWS, 16, 2), batch(SHORT, 32, 3)):
            self.step(b)
        self.compile_s, self.graphs = time.perf_counter() - start, counters["stats"]["unique_graphs"] - g0
        self.extra = 0


f = torch.compile(lambda x: (x * 2).sin().sum())
f(torch.randn(8, requires_grad=True)).backward()
names = ["padded rows", "dynamic rows", "static rows"]
variants = []
for tag, order in enumerate([names, names[::-1]]):
    for name in order:
        v = Variant(name, tag)
        v.compile()
        variants.append(v)
        print(f"compiled {name:13s} (round {tag}) in {v.compile_s:5.1f} s, {v.graphs} graphs", flush=True)
eager_model = tiny_model(layers=2, hidden=HIDDEN)
eager_times = []
for i in range(int(os.environ.get("ROUNDS", 80))):
    full = batch(ROWS, 32 if i % 2 else 16, 100 + i)
    for v in variants:
        v.times.append(v.step({k: t.clone() for k, t in full.items()}))
    t = time.perf_counter()
    template(eager_model, full).backward()
    eager_model.zero_grad(set_to_none=True)
    eager_times.append(time.perf_counter() - t)
    short = batch(SHORT, 32, 500 + i)
    for v in variants:
        v.short.append(v.step({k: t.clone() for k, t in short.items()}))
print(f"eager: full-batch step p50 {1000 * statistics.median(eager_times):.2f} ms")
for name in names:
    vs = [v for v in variants if v.name == name]
    print(
        f"{name:13s} compile {' / '.join(f'{v.compile_s:.1f}' for v in vs)} s ({vs[0].graphs} graphs); "
        f"full-batch step p50 {' / '.join(f'{1000 * statistics.median(v.times):.2f}' for v in vs)} ms; "
        f"short-batch step p50 {' / '.join(f'{1000 * statistics.median(v.short):.2f}' for v in vs)} ms; "
        f"graphs after warm-up {' / '.join(str(v.extra) for v in vs)}"
    )
