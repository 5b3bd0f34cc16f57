"""The file tree reads as the architecture: policy -> plan -> launch, and no module reaches upward;
below the library, the CUDA-on-CPU shim, which knows nothing of it."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "metrale_attn"
SHIM = ROOT / "cuda_on_cpu"

# Lower layers first; a module may import only modules of lower layers (or its own subpackage).
LAYERS = [
    {"policy", "cache", "logs"},
    {"targets", "dtypes", "reference", "tolerance", "hf_config"},
    {"tiling", "features"},
    {"config"},
    {"plan", "problems", "models"},
    {"sources"},
    {"kernels"},
    {"backends"},
    {"validation"},
    {"workspace"},
    {"binding"},
    {"attention", "merge"},
    {"demo", "torch_op", "precompile"},
    {"serving", "check"},
    {"integrations"},
    {"cli"},
    {"__init__", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
ALLOWED = {"reference": {"policy"}, "tolerance": set(), "problems": {"reference"}, "dtypes": set(),
           "hf_config": set(), "features": {"dtypes"}}
"""Modules that may import even less than their layer allows: the reference (the oracle)
and the tolerance (the bar) share no code with what they check, the problem builder asks
only the oracle, the Hugging Face config reader is a pure mapping of a JSON object, and the
feature records, under config, read only the dtype spellings."""


def _top(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0].removesuffix(".py")


def _imports(path: pathlib.Path) -> set[str]:
    """Package modules ``path`` imports (relative or absolute), as top-level names."""
    tree = ast.parse(path.read_text())
    depth = len(path.relative_to(PACKAGE).parts) - 1  # 0 for metrale_attn/x.py
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                if node.level - 1 < depth:  # stays inside the subpackage
                    continue
                parts = (node.module or "").split(".")
                names = [parts[0]] if parts[0] else [a.name for a in node.names]
            elif (node.module or "").startswith("metrale_attn."):
                names = [node.module.split(".")[1]]
            else:
                continue
            found.update(names)
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("metrale_attn."))
    return found


def test_every_module_imports_only_from_layers_below_it():
    offences = []
    for path in sorted(PACKAGE.rglob("*.py")):
        me = _top(path)
        for other in _imports(path) - {me}:
            allowed = ALLOWED.get(me)
            if RANK[other] >= RANK[me] or (allowed is not None and other not in allowed):
                offences.append(f"{path.relative_to(PACKAGE)} imports {other}")
    assert not offences


def test_every_module_has_a_layer():
    names = {_top(p) for p in PACKAGE.rglob("*.py")}
    assert names <= set(RANK), names - set(RANK)


SHIM_LAYERS = ["errors", "environment", "declarations", "abi", "asan", "isolation", "module", "build",
               "__init__", "_child"]
"""The CUDA-on-CPU package's own modules, lowest first (its ``__init__`` lists what each owns)."""


def _shim_imports(path: pathlib.Path) -> set[str]:
    """Modules of cuda_on_cpu that ``path`` (one of them) imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 1:
                found.update([module.split(".")[0]] if module else [a.name for a in node.names])
            elif module.startswith("cuda_on_cpu."):
                found.add(module.split(".")[1])
            elif module == "cuda_on_cpu":
                found.add("__init__")
    return found


def test_every_module_of_the_cpu_shim_imports_only_modules_below_it():
    assert sorted(p.stem for p in SHIM.glob("*.py")) == sorted(SHIM_LAYERS)
    rank = {name: i for i, name in enumerate(SHIM_LAYERS)}
    offences = [f"{path.name} imports {other}" for path in sorted(SHIM.glob("*.py"))
                for other in _shim_imports(path) if rank[other] >= rank[path.stem]]
    assert not offences


def _top_level_imports(path: pathlib.Path) -> set[str]:
    """The top-level names of every absolute import in ``path``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
    return found


def test_the_cpu_shim_and_its_tests_import_nothing_of_metrale_attn():
    """The shim is a package below the library, for any project to reuse: neither it nor its
    tests may lean on metrale_attn, nor on the library's test helpers (tests/support/, tests/conftest.py)."""
    offences = [f"{path.relative_to(ROOT)} imports {name}" for path in sorted(SHIM.rglob("*.py"))
                for name in _top_level_imports(path) & {"metrale_attn", "support", "conftest"}]
    assert not offences
