"""Cubins are whole ELF files, and the on-disk cache never loads a damaged one.

CuPy's ``nvrtc.getCUBIN`` returns NVRTC's buffer minus its last byte; the backend calls
NVRTC through cuda-bindings instead (``backends.nvrtc``), which reads it whole. These tests parse
every compiled cubin's ELF header, run ``nvdisasm`` on the cached files as written
(no patching), and damage cache entries to see them rebuilt.
"""

import json
import pathlib
import subprocess
import sys

import pytest
from support.builds import ARCHES, SPOT_SPECS, nvrtc_build

from benchmarks.model.sass_model import find_nvdisasm
from metrale_attn.backends import cubin
from metrale_attn.kernels import KernelSpec, all_specs
from metrale_attn.plan import ARMS

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings is not installed")

from metrale_attn.backends import cupy_backend, nvrtc  # noqa: E402  (needs cupy)


def _elf_sample() -> list:
    """The spot specs (the largest cubins: every feature, the widest dims, fp8) on every
    architecture that builds them: what CuPy's getter loses is the file's last byte, whatever
    the kernel, so the layouts of a few sizes on each architecture's ELF flavour are the test.
    The default run takes the first two on sm_90, sm_100 and sm_120; the rest are ``slow``."""
    return [pytest.param(v, arch, id=f"{v.name}-{arch}",
                         marks=[] if arch in ("sm_90", "sm_100", "sm_120") and i < 2 else [pytest.mark.slow])
            for arch in ARCHES for i, v in enumerate(SPOT_SPECS) if v.builds_for(arch)]


@pytest.mark.parametrize("spec, arch", _elf_sample())
def test_every_compiled_cubin_is_a_complete_elf_file(spec, arch):
    data, _ = nvrtc_build(spec, arch)
    assert data[:4] == cubin.ELF_MAGIC
    # Section and program header tables, sections and segments all end inside the file,
    # and the file is exactly as long as its header says.
    assert cubin.elf_extent(data) == len(data)
    cubin.check_cubin(data)
    with pytest.raises(cubin.CubinError, match="headers describe"):
        cubin.check_cubin(data[:-1])  # what CuPy's getCUBIN alone returns


def _cupy_compile(source: str, options: tuple[str, ...]):
    """CuPy's NVRTC on the same program: ``(getCUBIN, getPTX)`` (no cubin for a ``compute_XY``
    target), the bytes the backend took before it called NVRTC through cuda-bindings."""
    from cupy_backends.cuda.libs import nvrtc as cupy_nvrtc

    program = cupy_nvrtc.createProgram(source, "toy.cu", [], [])
    try:
        cupy_nvrtc.compileProgram(program, list(options))
        real = "=compute_" not in options[-1]  # the architecture, last
        return cupy_nvrtc.getCUBIN(program) if real else None, cupy_nvrtc.getPTX(program)
    finally:
        cupy_nvrtc.destroyProgram(program)


def _nvrtc_libraries() -> set[str]:
    """The ``libnvrtc`` files mapped into this process (Linux's /proc/self/maps)."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = {line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6}
    return {p for p in paths if pathlib.Path(p).name.startswith("libnvrtc.so")}


def test_the_cubin_is_cupys_getcubin_and_the_one_byte_cupy_drops_and_the_ptx_is_cupys():
    spec = KernelSpec("splitk", 64, "bf16", "bf16", "simt")
    source, options = cupy_backend.nvrtc_program(spec)
    cupy_cubin, cupy_ptx = _cupy_compile(source, (*options, "--gpu-architecture=sm_90"))
    ours = cupy_backend.compile_cubin(spec, "sm_90")
    assert len(ours) == len(cupy_cubin) + 1 and ours.startswith(cupy_cubin)
    assert cubin.elf_extent(ours) == len(ours)
    assert cupy_backend.nvrtc_compile(spec, "sm_90", with_ptx=True)[2] == cupy_ptx
    assert cupy_backend.nvrtc_compile(spec, "compute_90")[0] == _cupy_compile(
        source, (*options, "--gpu-architecture=compute_90"))[1]


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").exists(), reason="reads Linux's /proc/self/maps")
def test_cuda_bindings_and_cupy_call_one_nvrtc_library_of_one_version():
    """The cache key holds the binding's NVRTC version: the NVRTC CuPy would have compiled with."""
    from cupy_backends.cuda.libs import nvrtc as cupy_nvrtc

    cupy_backend.compile_cubin(KernelSpec("splitk", 64, "bf16", "bf16", "simt"), "sm_90")
    _cupy_compile('extern "C" __global__ void toy() {}', ("--gpu-architecture=sm_90",))
    assert len(_nvrtc_libraries()) == 1, _nvrtc_libraries()
    assert nvrtc.version() == tuple(cupy_nvrtc.getVersion())
    assert set(nvrtc.supported_archs()) == set(cupy_nvrtc.getSupportedArchs())


def test_a_source_nvrtc_refuses_is_an_error_with_the_kernel_the_architecture_and_the_log():
    with pytest.raises(RuntimeError, match=r"NVRTC failed on toy for sm_90:\n.*identifier \"undeclared\""):
        cupy_backend.nvrtc_compile_source('extern "C" __global__ void toy() { undeclared = 1; }', "toy", "sm_90")


def test_without_cuda_bindings_nvrtc_is_an_import_error_naming_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import fails, as without cuda-bindings
    with pytest.raises(ImportError, match=r"cuda-bindings, which is not installed .*metrale-attn\[cuda12\]"):
        nvrtc.version()


def test_registers_recorded_in_the_cubin_match_ptxas():
    spec = KernelSpec("splitk", 128, "bf16", "fp8")
    data, log = nvrtc_build(spec, "sm_90")
    counts = cubin.kernel_register_counts(data)
    assert set(counts) == set(spec.kernels)
    for kernel, registers in counts.items():
        assert f"Compiling entry function '{kernel}'" in log
        section = log.split(f"Compiling entry function '{kernel}'")[1]
        assert f"Used {registers} registers" in section.split("Compiling entry function")[0]


FAMILY_ARCHES = ("sm_90",)
"""The architecture the default run disassembles (~4 s each); the others run under ``slow``
(.ci/run's slow step)."""


@pytest.mark.parametrize("arch", [a if a in FAMILY_ARCHES else pytest.param(a, marks=pytest.mark.slow) for a in ARCHES])
def test_nvdisasm_accepts_the_cached_cubins_unpatched(arch, tmp_path, monkeypatch):
    nvdisasm = find_nvdisasm()
    if nvdisasm is None:
        pytest.skip("nvdisasm not found (pip install nvidia-cuda-nvdisasm)")
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cupy_backend, "compile_cubin", lambda v, a: nvrtc_build(v, a)[0])
    for arm in ARMS:
        spec = next(v for v in all_specs() if v.arm == arm)
        path = cupy_backend.cubin_path(spec, arch)
        done = subprocess.run([nvdisasm, "-c", "-ndf", path], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert all(f"{kernel}:" in done.stdout for kernel in spec.kernels), done.stderr


VARIANT = KernelSpec("unpacked", 64, "fp16", "fp8")


@pytest.fixture
def counted(monkeypatch, tmp_path):
    """cubin_path in a fresh cache directory, counting compiles."""
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cubin, "_fallback_dir", None)
    calls = []
    monkeypatch.setattr(cupy_backend, "compile_cubin", lambda v, a: calls.append(a) or nvrtc_build(v, a)[0])
    return calls


@pytest.mark.parametrize("damage", ["truncated", "empty", "garbage", "same size, other bytes", "no sidecar",
                                    "sidecar garbage"])
def test_a_damaged_cache_entry_is_rebuilt_not_loaded(counted, damage):
    path = pathlib.Path(cupy_backend.cubin_path(VARIANT, "sm_90"))
    good = path.read_bytes()
    sidecar = path.with_name(path.name + ".json")
    assert json.loads(sidecar.read_text()) == {"arch": "sm_90", "nvrtc": cubin.nvrtc_label(nvrtc.version()),
                                               "size": len(good), "sha256": cubin.hashlib.sha256(good).hexdigest()}
    if damage == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "garbage":
        path.write_bytes(b"\x00garbage" * 100)
    elif damage == "same size, other bytes":
        path.write_bytes(good[:-16] + bytes(16))
    elif damage == "no sidecar":
        sidecar.unlink()
    else:
        sidecar.write_text("{not json")
    assert cubin.read_cached(path) is None
    again = pathlib.Path(cupy_backend.cubin_path(VARIANT, "sm_90"))
    assert again == path and again.read_bytes() == good
    assert counted == ["sm_90", "sm_90"]
    assert cubin.read_cached(path) == good


def test_a_cache_filled_by_another_nvrtc_is_warned_about_when_this_one_compiles_again(counted, tmp_path,
                                                                                        monkeypatch):
    """What the server sees: the entries precompile left carry their NVRTC version, which
    ``warn_other_nvrtc`` holds against the NVRTC of the process that now misses them all."""
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    cupy_backend.cubin_lookup(VARIANT, "sm_90", tmp_path)
    mine = nvrtc.version()
    with pytest.warns(RuntimeWarning, match=f"built by NVRTC {cubin.nvrtc_label(mine)} and none by this "
                                            r"environment's NVRTC 99\.0"):
        assert cubin.warn_other_nvrtc(tmp_path / "cubin", "sm_90", (99, 0)) == {cubin.nvrtc_label(mine)}
    assert cubin.warn_other_nvrtc(tmp_path / "cubin", "sm_90", mine) == set()  # once: already checked
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    assert cubin.warn_other_nvrtc(tmp_path / "cubin", "sm_90", mine) == set()  # its own NVRTC: nothing to say


def test_a_whole_cache_entry_is_used_without_compiling(counted):
    first = cupy_backend.cubin_path(VARIANT, "sm_90")
    assert cupy_backend.cubin_path(VARIANT, "sm_90") == first
    assert counted == ["sm_90"]


def test_an_unwritable_cache_directory_falls_back_to_a_private_temporary_one(counted, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(blocker / "cache"))  # mkdir fails, even for root
    with pytest.warns(RuntimeWarning, match="not writable") as warned:
        first = pathlib.Path(cupy_backend.cubin_path(VARIANT, "sm_90"))
        other = pathlib.Path(cupy_backend.cubin_path(KernelSpec("splitk", 64, "bf16", "bf16"), "sm_90"))
        again = pathlib.Path(cupy_backend.cubin_path(VARIANT, "sm_90"))
    (warning,) = [str(w.message) for w in warned if "not writable" in str(w.message)]
    assert first == again and first.parent == other.parent
    assert f"caching cubins in {first.parent} for this process only" in warning  # it says where they went
    assert not str(first).startswith(str(blocker))
    assert cubin.read_cached(first) is not None and counted == ["sm_90", "sm_90"]
