"""The packages import one way (README, "Packages and import order"): every `import` / `from` in every module of
pallas_kernels, dsv41, sharding and serving - at the top, inside functions, anywhere - points to its own layer
or a lower one. A module that fits no layer fails too, so a new package has to be placed on purpose."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pallas_kernels", "dsv41", "sharding", "serving")

# Lowest first. "pkg.*" is a package and all its modules, a plain name is that one module. Entry points may
# import anything below them; the benchmarks, then tests and tools, anything at all (package code never
# imports tests: they are not installed).
LAYERS = (
    ("pallas_kernels.*",),
    ("dsv41.*",),
    ("sharding.*",),
    ("serving.runtime.*",),
    ("serving.text.*",),
    ("serving.engine.*",),
    ("serving.api.*",),
    ("serving", "serving.llm", "serving.server", "serving.model_source", "serving.launch", "serving.profile"),
    ("serving.bench.*",),
    ("tests.*", "tools.*", "notebooks.*"),
)


def layer_of(module: str) -> int | None:
    for i, patterns in enumerate(LAYERS):
        for pat in patterns:
            if module == pat.removesuffix(".*") or (pat.endswith(".*") and module.startswith(pat[:-1])):
                return i
    return None


def layer_name(i: int) -> str:
    return " / ".join(p.removesuffix(".*") for p in LAYERS[i])


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def imported_modules(path: Path, source: str, module: str):
    """(line, imported module) for every import in the source (`from a import b` is `a.b` when that is a
    module, else `a`; relative imports resolved against the file's package)."""
    tree = ast.parse(source, str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                yield node.lineno, sub if is_module(sub) else base


def violations(sources: dict[Path, str]) -> list[str]:
    """What breaks the layer order in these files (path -> source text), one line each."""
    out = []
    for path, source in sources.items():
        module = module_name(path)
        own = layer_of(module)
        if own is None:
            out.append(f"{path.relative_to(ROOT)}: module {module} is in no layer (add it to LAYERS)")
            continue
        for line, target in imported_modules(path, source, module):
            if target.split(".")[0] not in PACKAGES + ("tests", "tools", "notebooks"):
                continue  # the standard library and third-party packages
            theirs = layer_of(target)
            if theirs is None:
                out.append(f"{path.relative_to(ROOT)}:{line}: imports {target}, which is in no layer")
            elif theirs > own:
                out.append(f"{path.relative_to(ROOT)}:{line}: {module} (layer {layer_name(own)}) imports {target} "
                           f"(layer {layer_name(theirs)}, above it)")
    return out


def package_files() -> list[Path]:
    return sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))


def import_cycles(sources: dict[Path, str]) -> list[str]:
    """Import circles among these files (path -> source text; every import, lazy ones too), one line each:
    "a -> b -> a". A layer may import itself, but not in a circle: each of its modules has one direction."""
    edges = {}
    for path, source in sources.items():
        module = module_name(path)
        edges[module] = {t for _, t in imported_modules(path, source, module) if t != module}
    cycles, state = [], {}  # state: 1 = on the current path, 2 = done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if target not in edges:
                continue  # outside these files
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [module, target]))
            elif target not in state:
                visit(target, path + [module])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [])
    return cycles


def test_packages_import_downwards_only():
    files = package_files()
    assert len(files) > 80  # the walk found the packages
    bad = violations({f: f.read_text(encoding="utf-8") for f in files})
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


@pytest.mark.parametrize("module, source, message", [
    ("sharding/mesh.py", "def f():\n    from serving.engine.engine import Engine\n",
     "sharding/mesh.py:2: sharding.mesh (layer sharding) imports serving.engine.engine (layer serving.engine"),
    ("serving/engine/output.py", "from serving.api import server\n",
     "serving.engine.output (layer serving.engine) imports serving.api.server (layer serving.api, above it)"),
    ("serving/api/chat.py", "import serving.llm\n", "imports serving.llm (layer serving / serving.llm"),
    ("serving/bench/serve.py", "from tests.conftest import XLA_CACHE\n", "imports tests.conftest (layer tests"),
    ("serving/text/encoding.py", "from .tokenizer import Tokenizer\nfrom ..engine import request\n",
     "serving.text.encoding (layer serving.text) imports serving.engine.request"),
    ("serving/novel.py", "import json\n", "module serving.novel is in no layer"),
])
def test_the_check_fails_on_upward_and_unplaced_imports(module, source, message):
    """The checker on a file holding a bad import: it names the file, the line and both layers."""
    bad = violations({ROOT / module: source})
    assert any(message in b for b in bad), bad


def test_the_benchmarks_import_one_way():
    """serving.bench imports within itself without a circle (it had one: sharding_report <-> memory_plan,
    sharding_report <-> full_size_lowering, through imports inside functions)."""
    files = sorted((ROOT / "serving" / "bench").glob("*.py"))
    assert len(files) > 20
    cycles = import_cycles({f: f.read_text(encoding="utf-8") for f in files})
    assert not cycles, "import circles in serving.bench:\n" + "\n".join(cycles)


def test_the_cycle_check_finds_a_circle_through_a_lazy_import():
    bench = ROOT / "serving" / "bench"
    sources = {bench / "sharding_report.py": "def main():\n    from serving.bench import memory_plan\n",
               bench / "memory_plan.py": "from serving.bench.layout_memory import memory_report\n"
                                         "from serving.bench.sharding_report import kv_bytes_per_request\n",
               bench / "layout_memory.py": "import numpy\n"}
    assert import_cycles(sources) == [
        "serving.bench.memory_plan -> serving.bench.sharding_report -> serving.bench.memory_plan"]
    sources[bench / "memory_plan.py"] = "from serving.bench.layout_memory import memory_report\n"
    assert import_cycles(sources) == []
