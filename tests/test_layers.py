"""The package's shape: layers whose imports only go down, small modules, and tests that
mirror the package without importing each other."""

from __future__ import annotations

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridkv"
LARGE_MODULE_LINES = 500
"""Past this a module gets a warning: look whether it holds more than one concept."""
MAX_MODULE_LINES = 1200
"""Past this a module is refused: no single concept of this package needs that much."""

LAYERS: dict[str, int] = {
    "hybridkv.paths": 0,
    "hybridkv.schema": 0,
    "hybridkv.native": 0,
    "hybridkv.metric_fields": 0,
    "hybridkv.tiers": 1,
    "hybridkv.groups": 2,
    "hybridkv.keys": 3,
    "hybridkv.layout": 3,
    "hybridkv.hits": 4,
    "hybridkv.transfer": 4,
    "hybridkv.connector": 5,
    "hybridkv.integrations": 6,
    "hybridkv.route": 6,
    "hybridkv.vllm": 7,
    "hybridkv.tools": 7,
    "hybridkv.cli": 8,
    "hybridkv": 9,  # the package's own __init__
}
"""A module may import modules of a lower layer, or of its own package."""

ENGINE_NEUTRAL = (
    "hybridkv.tiers",
    "hybridkv.groups",
    "hybridkv.keys",
    "hybridkv.hits",
    "hybridkv.layout",
    "hybridkv.transfer",
    "hybridkv.connector",
    "hybridkv.route",
)


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _layer(module: str) -> tuple[str, int]:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return best, LAYERS[best]


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, lazy ones included."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def test_every_module_belongs_to_a_layer() -> None:
    assert all(_layer(m) for m in _modules())


def test_imports_only_go_down() -> None:
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        home, rank = _layer(module)
        for line, imported in _imports(path, module):
            if imported not in modules:
                continue  # another library, or a name imported from a module
            other_home, other_rank = _layer(imported)
            if other_home != home and other_rank >= rank:
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported} (layer up)")
    assert not wrong, "\n".join(wrong)


def test_engine_neutral_layers_never_import_an_engine() -> None:
    wrong = []
    for module, path in _modules().items():
        if not module.startswith(ENGINE_NEUTRAL):
            continue
        for line, imported in _imports(path, module):
            if imported.split(".")[0] in ("vllm", "sglang"):
                wrong.append(f"{path.relative_to(ROOT)}:{line} imports {imported}")
    assert not wrong, "\n".join(wrong)


def test_modules_stay_small() -> None:
    """Modules are split by concept, not by a count: a large one is a warning to read it
    again, and only a size no concept here needs fails."""
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for path in _modules().values()
    }
    large = {path: n for path, n in sizes.items() if n > LARGE_MODULE_LINES}
    if large:
        warnings.warn(
            f"modules over {LARGE_MODULE_LINES} lines (one concept each?): {large}", stacklevel=1
        )
    too_large = {path: n for path, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not too_large, f"modules over {MAX_MODULE_LINES} lines: {too_large}"


def test_modules_that_compile_with_numba_import_native() -> None:
    """``hybridkv.native`` wraps llvmlite's library when imported; numba code compiled
    without it breaks the next vLLM engine started in the process (``native``'s docstring).
    """
    wrong = []
    for module, path in _modules().items():
        imported = {name for _, name in _imports(path, module)}
        compiles = any(name.split(".")[0] == "numba" for name in imported)
        if compiles and module != "hybridkv.native" and "hybridkv.native" not in imported:
            wrong.append(f"{path.relative_to(ROOT)} imports numba, not hybridkv.native")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize(
    ("module", "heavy"),
    [
        ("hybridkv.connector", "torch"),
        ("hybridkv.connector.scheduler", "torch"),
        ("hybridkv.connector.config", "torch"),
        ("hybridkv.tiers.registry", "mooncake"),
        ("hybridkv.tiers.registry", "redis"),
        ("hybridkv.cli", "vllm"),
        ("hybridkv.cli.bench", "vllm"),
        ("hybridkv.cli.bench", "matplotlib"),
        ("hybridkv.cli.bench", "aiohttp"),
    ],
)
def test_light_imports_stay_light(module: str, heavy: str) -> None:
    code = f"import sys, {module}; print({heavy!r} in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert result.stdout.strip() == "False", f"importing {module} imports {heavy}"


def test_tests_mirror_the_package_and_do_not_import_each_other() -> None:
    tests = ROOT / "tests"
    shared = {"support", "e2e", "faults", "gpu"}  # cross-cutting suites (gpu: needs CUDA)
    for directory in tests.rglob("*"):
        if not directory.is_dir() or directory.name == "__pycache__":
            continue
        relative = directory.relative_to(tests)
        if relative.parts[0] in shared:
            continue
        assert (PACKAGE / relative).is_dir(), f"tests/{relative} mirrors no package folder"
    wrong = []
    for path in tests.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module or "" if isinstance(node, ast.ImportFrom) else ""
            if module.startswith("tests.") and module.rpartition(".")[2].startswith("test_"):
                wrong.append(f"{path.relative_to(ROOT)} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_benchmarks_import_only_the_package_not_the_tests() -> None:
    """A benchmark runs on the package (the simulated engine is ``hybridkv.tools.sim``),
    never on the test suite, which is free to change."""
    scripts = sorted((ROOT / "benchmarks").rglob("*.py"))
    assert scripts, "no benchmarks found"
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {imported}"
        for path in scripts
        for line, imported in _imports(path, f"benchmarks.{path.stem}")
        if imported.split(".")[0] == "tests"
    ]
    assert not wrong, "\n".join(wrong)
