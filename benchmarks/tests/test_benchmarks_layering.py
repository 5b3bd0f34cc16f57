"""benchmarks/ is a package beside the library: the GPU harness (its top-level modules) above the static
SASS model (``benchmarks/model/``); each side's modules import only downward, the model never imports the
harness, the library never imports either, and each ``__init__`` maps its modules."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
MODEL = PACKAGE / "model"

# Lower layers first; a module may import only modules of lower layers of its own side (and metrale_attn);
# a harness module may import any module of the model, a model module none of the harness.
LAYERS = [
    {"__init__", "schedule", "steps", "environment", "impls", "decode_loop_check", "host_overhead", "cubin_identity"},
    {"baselines", "sweep_plan", "pdl_check", "model_probes"},
    {"l2_probe", "sanitize_cases"},
    {"report"},
    {"sweep", "summary"},
]
MODEL_LAYERS = [
    {"__init__", "model_assumptions", "hot_loop", "predictions"},
    {"sass"},
    {"warp_chain"},
    {"call_model"},
    {"sass_model"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MODEL_RANK = {name: i for i, layer in enumerate(MODEL_LAYERS) for name in layer}


def _modules() -> list[pathlib.Path]:
    return sorted(PACKAGE.glob("*.py"))


def _model_modules() -> list[pathlib.Path]:
    return sorted(MODEL.glob("*.py"))


def _name(path: pathlib.Path) -> str:
    """``benchmarks.sweep``, ``benchmarks.model.sass``; a package's ``__init__`` as ``benchmarks.model.__init__``."""
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def _resolve(dotted: str) -> str:
    """A dotted name as the module it is: a package's name is its ``__init__``."""
    return dotted + ".__init__" if (ROOT / dotted.replace(".", "/")).is_dir() else dotted


def _imports(path: pathlib.Path) -> set[str]:
    """Modules of the benchmarks package that ``path`` imports (relative or absolute), lazily or not, as
    dotted names (``benchmarks.model.sass``)."""
    package = _name(path).split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            if (ROOT / module.replace(".", "/")).is_dir():  # from a package: its submodules, or its __init__
                found.update(f"{module}.{a.name}" if (ROOT / module.replace(".", "/") / f"{a.name}.py").exists()
                             else f"{module}.__init__" for a in node.names)
            else:
                found.add(module)
        elif isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names)
    return {name for name in found if name.split(".")[0] == "benchmarks"}


def _offence(me: str, other: str) -> bool:
    mine, theirs = me.split("."), other.split(".")
    if theirs[1] == "model":
        if mine[1] != "model":
            return False  # the harness reads the model
        return MODEL_RANK[theirs[2]] >= MODEL_RANK[mine[2]]
    if mine[1] == "model":
        return True  # the model never reaches up to the harness
    return RANK[theirs[1]] >= RANK[mine[1]]


def test_every_module_has_a_layer():
    assert {p.stem for p in _modules()} == set(RANK)
    assert {p.stem for p in _model_modules()} == set(MODEL_RANK)


def test_every_module_imports_only_from_layers_below_it():
    offences = [f"{_name(path)} imports {other}" for path in _modules() + _model_modules()
                for other in _imports(path) if _offence(_name(path), other)]
    assert not offences


def test_the_model_imports_nothing_of_the_harness():
    offences = [f"{_name(path)} imports {other}" for path in _model_modules() for other in _imports(path)
                if not other.startswith("benchmarks.model.")]
    assert not offences


def test_no_module_puts_a_directory_on_sys_path():
    """The package is imported as a package (``python -m benchmarks.<module>`` from the root), never
    by putting benchmarks/ or the root on ``sys.path``."""
    offences = []
    for path in _modules() + _model_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr in ("insert", "append", "extend") and \
                    ast.unparse(func.value) == "sys.path":
                offences.append(f"{_name(path)}:{node.lineno}")
    assert not offences


def test_the_library_never_imports_benchmarks():
    offences = []
    for path in sorted((ROOT / "metrale_attn").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offences += [f"{path.relative_to(ROOT)} imports {n}" for n in names if n.split(".")[0] == "benchmarks"]
    assert not offences


def test_each_package_docstring_maps_every_module():
    for package, modules in ((PACKAGE, _modules()), (MODEL, _model_modules())):
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()))
        assert [p.stem for p in modules if p.stem != "__init__" and f"``{p.stem}``" not in doc] == []
    assert "``model``" in ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
