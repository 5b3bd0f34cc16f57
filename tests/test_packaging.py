"""The wheel carries the kernel sources and the CUDA-on-CPU shim (a package of its own, without its
tests), so a non-editable install finds them."""

import importlib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the test extra installs tomli
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    if shutil.which("pip") is None and not _has_module("pip"):
        pytest.skip("pip is not available")
    out = tmp_path_factory.mktemp("wheel")
    # Build from a clean copy: a checkout's build/ and *.egg-info (an editable install
    # leaves one) would let setuptools ship files pyproject.toml forgot.
    src = tmp_path_factory.mktemp("src") / "metrale-attn"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".venv", ".pytest_cache", ".hypothesis", ".whl",
        "gpu_check_out"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(out), "."],
        cwd=src, check=True, capture_output=True,
    )
    (built,) = out.glob("metrale_attn-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel_names(wheel):
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def _has_module(name):
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_every_kernel_source_is_shipped_inside_the_package(wheel_names):
    folder = ROOT / "kernels_cu"
    sources = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.suffix in (".cu", ".cuh"))
    assert any("/" in name for name in sources)  # the simt/ folder is searched too
    missing = [name for name in sources if f"metrale_attn/kernels_cu/{name}" not in wheel_names]
    assert not missing


def test_the_cpu_backend_ships_its_shim(wheel_names):
    """The shim's modules and every runtime source it compiles; its tests and speed scripts stay in the repository."""
    shim = ROOT / "cuda_on_cpu"
    shipped = sorted(p.relative_to(ROOT).as_posix() for p in shim.rglob("*")
                     if p.suffix in (".py", ".h", ".hpp", ".cpp", ".S") and not {"tests", "bench"} & set(p.relative_to(shim).parts))
    assert "cuda_on_cpu/cuda_on_cpu.h" in shipped and "cuda_on_cpu/build.py" in shipped
    missing = [name for name in shipped if name not in wheel_names]
    assert not missing
    assert not [name for name in wheel_names if name.startswith(("cuda_on_cpu/tests/", "cuda_on_cpu/bench/"))]


@pytest.mark.slow  # ~5 s on two cores: .ci/run's slow step runs it
def test_the_shim_builds_and_launches_from_a_non_editable_install(wheel, tmp_path):
    """Unpacked, the wheel is the install: the shim compiles its runtime from the shipped sources
    and launches in a child process that imports the shim from there too; the library finds
    its kernel sources there."""
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(site)
    code = (
        "import sys\n"
        f"sys.path.insert(0, {str(site)!r})\n"
        "import numpy as np\n"
        "import cuda_on_cpu, metrale_attn\n"
        "from metrale_attn import kernels\n"
        f"assert all(m.__file__.startswith({str(site)!r}) for m in (cuda_on_cpu, metrale_attn))\n"
        "assert 'pd_ptx.cuh' in kernels.KernelSpec('unpacked', 128, 'bf16', 'fp8', 'mma').source()\n"
        "src = 'extern \"C\" __global__ void ones(float* out) { out[threadIdx.x] = 1.0f; }'\n"
        "out = np.zeros(32, np.float32)\n"
        "cuda_on_cpu.compile_module(src, name='from_the_wheel').launch('ones', 1, 32, 0, (out,), isolate=True)\n"
        "assert (out == 1).all()\n"
    )
    env = dict(os.environ, CUDA_ON_CPU_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_a_second_checkout_imported_through_pythonpath_compiles_its_own_kernel_sources(tmp_path):
    """A git worktree tested with ``PYTHONPATH=<worktree>`` beside an editable install of another
    checkout: the editable install maps ``metrale_attn.kernels_cu`` to its own checkout's folder,
    so the worktree's kernel edits would go untested; the sources are the importing checkout's."""
    checkout = tmp_path / "worktree"
    shutil.copytree(ROOT / "metrale_attn", checkout / "metrale_attn", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "kernels_cu", checkout / "kernels_cu")
    shutil.copy(ROOT / "pyproject.toml", checkout)
    marker = "// an edit in the worktree only"
    header = checkout / "kernels_cu" / "pd_common.cuh"
    header.write_text(header.read_text() + marker + "\n")
    code = ("import metrale_attn, metrale_attn.sources as s\n"
            f"assert metrale_attn.__file__.startswith({str(checkout)!r}), metrale_attn.__file__\n"
            f"assert {marker!r} in s.read_source('pd_common.cuh'), s._source_dir()\n")
    env = dict(os.environ, PYTHONPATH=str(checkout))
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_the_console_script_is_declared_and_names_a_function_that_exists():
    with open(ROOT / "pyproject.toml", "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {"metrale-attn": "metrale_attn.cli:main"}
    module, function = scripts["metrale-attn"].split(":")
    assert callable(getattr(importlib.import_module(module), function))


def test_every_subpackage_is_in_the_wheel(wheel_names):
    """A subpackage missing from pyproject's list (backends once was) breaks every non-editable install."""
    packages = sorted(p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "metrale_attn").rglob("__init__.py"))
    missing = [pkg for pkg in packages if f"{pkg}/__init__.py" not in wheel_names]
    assert not missing
    assert "metrale_attn/backends/cupy_backend.py" in wheel_names


def test_the_vllm_plugin_is_declared_and_names_a_function_that_exists():
    """``pip install metrale-attn[vllm]`` is the whole install: vLLM finds the backend through this
    entry point (its plugin loader calls it in every process)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    plugins = project["entry-points"]["vllm.general_plugins"]
    assert plugins == {"metrale_attn": "metrale_attn.integrations.vllm:register"}
    module, function = plugins["metrale_attn"].split(":")
    assert callable(getattr(importlib.import_module(module), function))
    assert any(req.startswith("vllm") for req in project["optional-dependencies"]["vllm"])


def test_the_wheel_ships_both_license_texts_and_an_spdx_expression(wheel_names, tmp_path_factory):
    licenses = {name.rsplit("/", 1)[-1] for name in wheel_names if "/licenses/" in name}
    assert {"LICENSE-MIT", "LICENSE-APACHE"} <= licenses
    with open(ROOT / "pyproject.toml", "rb") as f:
        project = tomllib.load(f)["project"]
    assert project["license"] == "MIT OR Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE-APACHE").read_text()
    assert "Permission is hereby granted" in (ROOT / "LICENSE-MIT").read_text()


def test_the_version_lives_in_one_place_and_the_changelog_names_it():
    import metrale_attn

    with open(ROOT / "pyproject.toml", "rb") as f:
        data = tomllib.load(f)
    assert "version" not in data["project"] and "version" in data["project"]["dynamic"]
    assert data["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "metrale_attn.__version__"}
    assert f"## {metrale_attn.__version__}" in (ROOT / "CHANGELOG.md").read_text()


def test_the_torch_extra_asks_for_a_range_that_never_replaces_an_engines_torch():
    with open(ROOT / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    (torch_req,) = extras["torch"]
    assert torch_req.startswith("torch>=") and "==" not in torch_req
    assert any(req.startswith("nvidia-cuda-nvrtc") for req in extras["cuda13"])
