"""benchmarks/ is a package beside the library: its modules import only downward, the library
never imports it, and its ``__init__`` maps every module."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"

# Lower layers first; a module may import only modules of lower layers (and metrale_attn).
LAYERS = [
    {"__init__", "schedule", "steps", "predictions", "environment", "impls", "hot_loop", "model_assumptions",
     "decode_loop_check", "host_overhead"},
    {"baselines", "sweep_plan", "sass", "pdl_check", "model_probes"},
    {"warp_chain"},
    {"call_model"},
    {"sass_model", "l2_probe", "sanitize_cases"},
    {"report"},
    {"sweep", "summary"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.glob("*.py"))


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of the benchmarks package that ``path`` imports (relative or absolute), lazily or not."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1 or module == "benchmarks":  # from . import x / from .x import y
                found.update([module.split(".")[0]] if node.level and module else [a.name for a in node.names])
            elif module.startswith("benchmarks."):
                found.add(module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("benchmarks."))
    return found


def test_every_module_has_a_layer():
    assert {p.stem for p in _modules()} == set(RANK)


def test_every_module_imports_only_from_layers_below_it():
    offences = [f"{path.name} imports {other}" for path in _modules() for other in _imports(path)
                if RANK[other] >= RANK[path.stem]]
    assert not offences


def test_no_module_puts_a_directory_on_sys_path():
    """The package is imported as a package (``python -m benchmarks.<module>`` from the root), never
    by putting benchmarks/ or the root on ``sys.path``."""
    offences = []
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in ("insert", "append", "extend") and \
                    ast.unparse(func.value) == "sys.path":
                offences.append(f"{path.name}:{node.lineno}")
    assert not offences


def test_the_library_never_imports_benchmarks():
    offences = []
    for path in sorted((ROOT / "metrale_attn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offences += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offences


def test_the_package_docstring_maps_every_module():
    doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert all(f"``{p.stem}``" in doc for p in _modules() if p.stem != "__init__")
