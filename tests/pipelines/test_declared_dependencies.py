"""Every third-party module `pipelines/` imports comes from a distribution pyproject declares, so `pip install .`
alone runs it (accelerate, scipy and ruamel.yaml once arrived only through other packages). Read from the source,
so an import inside a function counts too. tests/e2e/test_clean_install.py imports every module in a venv built from
`pip install .` alone, the check a static reading cannot make (a module that imports what its distribution lacks)."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

from tests.conftest import REPO_ROOT

# Imported only where a user asks for them, each behind a check that names the install.
OPTIONAL = {
    "bitsandbytes": "optim: adamw_8bit (train/optim.py says: pip install bitsandbytes)",
    "liger_kernel": "kernels: liger (train/memory_levers.py says: pip install liger-kernel)",
    "pynvml": "the [gpu] extra: NVML on a CUDA machine (tracking/environment.py)",
}
# Distributions that are part of a declared one, pinned by it to its own version.
PART_OF = {"pydantic_core": "pydantic"}


def imported_top_level_names() -> dict[str, set[str]]:
    """Each third-party top-level module imported anywhere under pipelines/, with the files that import it."""
    found: dict[str, set[str]] = {}
    for path in (REPO_ROOT / "pipelines").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module.split(".")[0]]
            else:
                continue
            for name in names:
                if name not in sys.stdlib_module_names and name not in ("pipelines", "__future__"):
                    found.setdefault(name, set()).add(str(path.relative_to(REPO_ROOT)))
    return found


def declared() -> set[str]:
    """The distributions pyproject's [project] dependencies name, normalised (PEP 503)."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return {normalise(re.match(r"[A-Za-z0-9._-]+", spec).group(0)) for spec in project["dependencies"]}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_imported_module_comes_from_a_declared_distribution():
    distributions = packages_distributions()
    wanted = declared()
    undeclared = {}
    for module, files in imported_top_level_names().items():
        if module in OPTIONAL or module in PART_OF:
            continue
        providers = {normalise(d) for d in distributions.get(module, [module])}
        if not providers & wanted:
            undeclared[module] = sorted(files)
    assert not undeclared, f"imported but not in pyproject's dependencies: {undeclared}"


def test_the_check_sees_an_import_inside_a_function_and_the_known_ones():
    found = imported_top_level_names()
    # Imported only inside functions: the three the issue found arriving through other packages.
    assert {"accelerate", "scipy", "ruamel"} <= set(found)
    assert {"accelerate", "scipy", "ruamel-yaml"} <= declared()
    assert set(OPTIONAL) <= set(found)  # an allowance for an import that is gone is removed, not kept


def test_every_library_whose_internals_we_read_has_an_upper_bound():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    bounded = {normalise(re.match(r"[A-Za-z0-9._-]+", s).group(0)) for s in project["dependencies"] if "<" in s}
    assert {"torch", "transformers", "mlflow", "dvc", "ray"} <= bounded
