"""The architecture page and the size limits agree with the code: computed from the source, not drawn by hand."""

from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT
from tests.import_graph import all_modules, cycles, imports_of, module_file, parsed

PAGE = REPO_ROOT / "docs/explanation/architecture.md"


def section(name: str) -> list[str]:
    text = PAGE.read_text(encoding="utf-8")
    body = text.split(f"<!-- {name}:begin -->", 1)[1].split(f"<!-- {name}:end -->", 1)[0]
    return [line.strip() for line in body.strip().splitlines() if line.strip()]


def test_no_import_circles_and_tasks_never_import_the_engine():
    assert cycles() == [], "import circles (see docs/explanation/architecture.md, Layering)"
    upward = {m: sorted(i for i in imports_of(m) if i.startswith("pipelines.train")) for m in all_modules()}
    assert {m: i for m, i in upward.items() if m.startswith("pipelines.tasks") and i} == {}


def test_every_import_points_down_the_layers_the_page_declares():
    layers = declared_layers()
    for module in all_modules():
        if not module.startswith("pipelines."):
            continue
        for imported in imports_of(module):
            assert layers[layer_key(imported)] <= layers[layer_key(module)], (
                f"{module} (layer {layers[layer_key(module)]}) imports {imported} "
                f"(layer {layers[layer_key(imported)]}): against the layering in docs/explanation/architecture.md"
            )


def test_only_trials_import_ray_and_only_tracking_imports_mlflow():
    for module in all_modules():
        found = external_imports(module)
        if "ray" in found:
            assert module.startswith("pipelines.trials"), module
        if "mlflow" in found:
            assert module.startswith(("pipelines.tracking", "stages")), module


def external_imports(module: str) -> set[str]:
    """Top-level packages a module imports at run time (imports for type hints only excluded)."""
    from tests.import_graph import _runtime_nodes

    names: set[str] = set()
    for node in _runtime_nodes(parsed(module)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def declared_layers() -> dict[str, int]:
    """The page's layer table: `- <n>: <module or package>, ...` lines between the layers markers."""
    layers: dict[str, int] = {}
    for line in section("layers"):
        number, _, names = line.removeprefix("- ").partition(":")
        for name in names.split(","):
            layers[name.strip().strip("`")] = int(number)
    return layers


def layer_key(module: str) -> str:
    """The layer table's entry for a module: itself, else its nearest package listed."""
    layers = declared_layers()
    parts = module.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in layers:
            return ".".join(parts[:i])
    raise AssertionError(f"{module} is in no layer of docs/explanation/architecture.md")


def test_the_page_names_every_module_of_the_package():
    text = PAGE.read_text(encoding="utf-8")
    for module in all_modules():
        if module.startswith("pipelines.") and module.count(".") >= 1:
            name = module.split(".")[-1]
            assert f"{name}" in text, f"docs/explanation/architecture.md does not mention {module}"


def test_no_module_is_over_400_lines_and_no_function_over_80():
    long_modules, long_functions = [], []
    for module in all_modules():
        path = module_file(module)
        if len(path.read_text(encoding="utf-8").splitlines()) > 400:
            long_modules.append(module)
        for node in ast.walk(parsed(module)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long_modules == []
    assert long_functions == []


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """A function's parameters, `self` and `cls` not counted, `*args` and `**kwargs` one each."""
    args = node.args
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return len(names) - (names[:1] in (["self"], ["cls"])) + (args.vararg is not None) + (args.kwarg is not None)


def test_no_function_takes_more_than_8_parameters_and_few_take_7():
    # Many loose parameters mean a missing object: the engine's entry took 13 before it took one TrainRequest.
    counts = [
        (f"{module}.{node.name}", parameter_count(node))
        for module in all_modules()
        for node in ast.walk(parsed(module))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    assert [(name, n) for name, n in counts if n > 8] == []
    many = sorted(name for name, n in counts if n >= 7)
    assert len(many) <= 8, many


def test_readme_is_a_newcomer_size_and_links_only_pages_that_exist():
    import re

    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.encode()) <= 10_000
    for page in [REPO_ROOT / "README.md", *(REPO_ROOT / "docs").rglob("*.md")]:
        for link in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text(encoding="utf-8")):
            assert (page.parent / link).is_file(), f"{page.relative_to(REPO_ROOT)} links {link}, which does not exist"


STEP_USERS = (
    "pipelines.train.trainer",  # the loop and its warm-up / memory probe
    "pipelines.resolve.lr_range",  # the LR range test
    "pipelines.resolve.batch_size",  # the batch-size probe
    "pipelines.resolve.memory_plan",  # the plan's fake step
)


def test_the_step_is_built_in_one_module_and_every_caller_runs_it():
    """`TrainStep` (pipelines/train/step.py) is the only place a step is assembled: nobody else scales a loss,
    unscales, clips or steps an optimizer, and the loop, the probes and the plan all build the step object."""
    assembling = ("scaler.scale(", ".unscale_(", "clip_grad_norm_(", "scaler.step(")
    for module in all_modules():
        if not module.startswith("pipelines.") or module == "pipelines.train.step":
            continue
        source = module_file(module).read_text(encoding="utf-8")
        found = [call for call in assembling if call in source]
        assert found == [], f"{module} assembles part of a step ({found}); use pipelines.train.step.TrainStep"
    for module in STEP_USERS:
        assert "TrainStep(" in module_file(module).read_text(encoding="utf-8"), f"{module} does not build the step"


def test_no_private_attribute_is_set_on_a_model():
    """Settings travel as arguments (the runtime, the loss, the offload context), never as `_name` attributes."""
    offenders = []
    for module in all_modules():
        if not module.startswith("pipelines."):
            continue
        for node in ast.walk(parsed(module)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" and len(node.args) >= 2:
                name = node.args[1]
                if isinstance(name, ast.Constant) and str(name.value).startswith("_"):
                    offenders.append(f"{module}:{node.lineno}")
                elif isinstance(name, ast.Name) and name.id.isupper():  # a module constant naming an attribute
                    offenders.append(f"{module}:{node.lineno}")
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Attribute) and target.attr.startswith("_pipelines"):
                        offenders.append(f"{module}:{node.lineno}")
    assert offenders == []
