"""Cubins are whole ELF files, and the on-disk cache never loads a damaged one.

CuPy's ``nvrtc.getCUBIN`` returns NVRTC's buffer minus its last byte; the backend asks
NVRTC for the full size instead (``backends.cubin.nvrtc_cubin``). These tests parse
every compiled cubin's ELF header, run ``nvdisasm`` on the cached files as written
(no patching), and damage cache entries to see them rebuilt.
"""

import json
import pathlib
import subprocess

import pytest
from support.builds import ARCHES, SPOT_SPECS, nvrtc_build

from benchmarks.model.sass_model import find_nvdisasm
from metrale_attn.backends import cubin
from metrale_attn.kernels import KernelSpec, all_specs
from metrale_attn.plan import ARMS

pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")

from metrale_attn.backends import cupy_backend  # noqa: E402  (needs cupy)


def _elf_sample() -> list:
    """The spot specs (the largest cubins: every feature, the widest dims, fp8) on every
    architecture that builds them: what CuPy's getter loses is the file's last byte, whatever
    the kernel, so the layouts of a few sizes on each architecture's ELF flavour are the test.
    The default run takes the first two on sm_90, sm_100 and sm_120; the rest are ``slow``."""
    return [pytest.param(v, arch, id=f"{v.name}-{arch}",
                         marks=[] if arch in ("sm_90", "sm_100", "sm_120") and i < 2 else [pytest.mark.slow])
            for arch in ARCHES for i, v in enumerate(SPOT_SPECS) if v.builds_for(arch)]


@pytest.mark.parametrize("spec, arch", _elf_sample())
def test_every_compiled_cubin_is_a_complete_elf_file(spec, arch, monkeypatch):
    data, _ = nvrtc_build(spec, arch)
    assert data[:4] == cubin.ELF_MAGIC
    # Section and program header tables, sections and segments all end inside the file,
    # and the file is exactly as long as its header says.
    assert cubin.elf_extent(data) == len(data)
    cubin.check_cubin(data)
    with pytest.raises(cubin.CubinError, match="headers describe"):
        cubin.check_cubin(data[:-1])  # what CuPy's getCUBIN alone returns
    # The fallback (NVRTC's size unreadable) restores exactly the byte CuPy strips.
    monkeypatch.setattr(cubin, "_warned_restore", False)
    with pytest.warns(RuntimeWarning, match="restored"):
        assert cubin._restore_stripped_tail(data[:-1], reason="test") == data


def test_the_cubin_is_read_from_the_nvrtc_library_cupy_loaded():
    from cupy_backends.cuda.libs import nvrtc

    lib = cubin._cupy_nvrtc_library(nvrtc.getVersion())
    major, minor = cubin.ctypes.c_int(), cubin.ctypes.c_int()
    assert lib.nvrtcVersion(cubin.ctypes.byref(major), cubin.ctypes.byref(minor)) == 0
    assert (major.value, minor.value) == tuple(nvrtc.getVersion())


def test_without_cupys_nvrtc_library_the_header_restores_the_stripped_byte(monkeypatch):
    """The fallback: where the library cannot be found, the ELF header gives the size."""
    spec = KernelSpec("gqa_packed", 256, "fp16", "fp8")
    monkeypatch.setattr(cubin, "_loaded_nvrtc_paths", lambda: [])
    monkeypatch.setattr(cubin, "_warned_restore", False)
    cubin._cupy_nvrtc_library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="expected one loaded NVRTC"):
            data, _ = cupy_backend.nvrtc_compile(spec, "sm_90")
    finally:
        cubin._cupy_nvrtc_library.cache_clear()
    assert data == nvrtc_build(spec, "sm_90")[0]


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
    from cupy_backends.cuda.libs import nvrtc

    assert json.loads(sidecar.read_text()) == {"arch": "sm_90", "nvrtc": cubin.nvrtc_label(nvrtc.getVersion()),
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
    from cupy_backends.cuda.libs import nvrtc

    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    cupy_backend.cubin_lookup(VARIANT, "sm_90", tmp_path)
    mine = nvrtc.getVersion()
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
