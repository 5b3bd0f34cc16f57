"""The names the prose gives are names the code has: every ``module.name`` of the package that
the README, docs/ or a docstring or comment of metrale_attn/ cites is an attribute of that
module, every CONSTANT it cites in backticks is defined somewhere (a module of the package or a
define of kernels_cu/), and every repository path it cites exists. A renamed or removed name
fails here rather than leaving a sentence that is no longer true."""

from __future__ import annotations

import importlib
import pathlib
import pkgutil
import re

import pytest

import metrale_attn

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROSE = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "kernels_cu" / "simt" / "README.md"]
CODE = sorted((ROOT / "metrale_attn").rglob("*.py"))
KERNELS = sorted((ROOT / "kernels_cu").rglob("*.cu*"))

TICKED = re.compile(r"``?([A-Za-z_][\w./-]*)(?:\([^`]*\))?``?")
"""A name in single or double backticks, an optional call's parentheses after it."""


def _modules() -> dict[str, object]:
    """Every module of the package by its short name (``plan``) and its dotted path
    (``backends.cpu_backend``)."""
    found = {}
    for info in pkgutil.walk_packages(metrale_attn.__path__, "metrale_attn."):
        if info.name.startswith("metrale_attn.integrations") or info.name.endswith("__main__"):  # optional engines; the CLI entry
            continue
        module = importlib.import_module(info.name)
        dotted = info.name.removeprefix("metrale_attn.")
        found[dotted] = module
        found.setdefault(dotted.rsplit(".", 1)[-1], module)
    return found


MODULES = _modules()
OBJECTS = {  # names the prose uses for an object of the package, beside the module of that name
    "config": ("config.LayerConfig",), "workspace": ("plan.Workspace", "numpy.ndarray"), "plan": ("plan.DecodePlan",),
    "spec": ("kernels.KernelSpec",), "target": ("targets.Target",),
}
EXTERNAL = {
    "EIATTR_REGCOUNT": "an attribute of a cubin's .nv.info section (the ELF CUDA writes)",
    "RTLD_NOLOAD": "a dlopen flag",
    "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION": "a CUDA driver launch attribute",
    "INFINITY": "CUDA's float infinity",
    "UNIFORM_BATCH": "vLLM's AttentionCGSupport", "UNIFORM_SINGLE_TOKEN_DECODE": "vLLM's AttentionCGSupport",
    "FULL_AND_PIECEWISE": "vLLM's CUDAGraphMode",
    "UNIFORM": "vLLM's MLA QueryLenSupport",
    "FAIL": "a verdict the check reports (a value, not a name)",
}
"""Names the prose cites that belong to CUDA, the OS or an engine, not to this package."""
DEFINED = set(EXTERNAL)
for module in MODULES.values():
    DEFINED |= set(vars(module))
    DEFINED |= {name for value in vars(module).values() if isinstance(value, type) for name in vars(value)}
for path in KERNELS:
    text = path.read_text()
    DEFINED |= set(re.findall(r"#(?:define|ifndef|ifdef|if)\s+!?(?:defined\()?(\w+)", text))
    DEFINED |= set(re.findall(r"\bdefined\((\w+)\)", text))
    DEFINED |= set(re.findall(r"\b(?:constexpr|enum|struct|class)\s+(?:\w+\s+)*?(\w+)\s*[={;(]", text))
    DEFINED |= set(re.findall(r"\b([A-Z][A-Z0-9_]+)\s*=", text))


def _owners(head: str) -> list:
    """What ``head.x`` may name: the module ``head`` and the package's objects it stands for."""
    owners = [MODULES[head]] if head in MODULES else []
    for dotted in OBJECTS.get(head, ()):
        module, _, attr = dotted.rpartition(".")
        owner = getattr(importlib.import_module(module if module == "numpy" else f"metrale_attn.{module}"), attr)
        owners.append(owner)
        owners += [f.name for f in getattr(owner, "__dataclass_fields__", {}).values()]
    return owners


def _texts():
    for path in PROSE:
        yield path, path.read_text()
    for path in CODE:
        yield path, path.read_text()


def _citations():
    """``(file, name)`` for every backticked name of the prose and the package's source."""
    for path, text in _texts():
        for name in TICKED.findall(text):
            yield path.relative_to(ROOT), name.rstrip(".")


def test_every_cited_module_attribute_exists():
    stale = []
    for where, name in _citations():
        if "/" in name or name.count(".") < 1:
            continue
        head, _, attr = name.rpartition(".")
        owners = _owners(head.removeprefix("metrale_attn."))
        if not owners or attr in ("py", "md", "cu", "cuh", "json", "png"):
            continue
        if not any(attr == o if isinstance(o, str) else hasattr(o, attr) for o in owners):
            stale.append(f"{where}: {name}")
    assert not stale, "\n".join(sorted(set(stale)))


@pytest.mark.parametrize("kind", ["prose", "package"])
def test_every_cited_constant_is_defined_somewhere(kind):
    stale = []
    for where, name in _citations():
        if (kind == "prose") != (where.suffix == ".md"):
            continue
        last = name.rpartition(".")[2]
        if re.fullmatch(r"[A-Z][A-Z0-9_]{3,}", last) and not last.startswith(("METRALE_", "VLLM_", "CUDA_")):
            if last not in DEFINED:
                stale.append(f"{where}: {name}")
    assert not stale, "\n".join(sorted(set(stale)))


def test_every_cited_repository_path_exists():
    stale = []
    for where, name in _citations():
        if re.fullmatch(r"(metrale_attn|kernels_cu|tests|benchmarks|docs|cuda_on_cpu|examples)/[\w./-]*", name):
            path = name.rstrip("/")
            module = ROOT / (path.rpartition(".")[0] + ".py")  # benchmarks/sweep_plan.FEATURES: a module's name
            installed = path == "metrale_attn/kernels_cu"  # where a wheel ships kernels_cu/
            if not (ROOT / path).exists() and not module.is_file() and not installed:
                stale.append(f"{where}: {name}")
    assert not stale, "\n".join(sorted(set(stale)))
