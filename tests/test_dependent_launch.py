"""Programmatic dependent launch of the split-K merge: which launches ask for it, the
driver call that makes it through cuda-bindings (checked against a stand-in libcuda.so.1 built
from the toolkit's own cuda.h, since CI has no GPU), and the device instructions that make it safe."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from metrale_attn import config as config_module
from metrale_attn.backends import dependent_launch
from metrale_attn.backends.cupy_backend import _CupyModule
from metrale_attn.kernels import KernelSpec
from support.builds import nvrtc_ptx
from support.problems import CountingBackend, check_against_reference, decoder, problem, run_poisoned

P = problem(seq_lens=(5, 300, 0), head_dim=64, page_size=16)
ROOT = Path(__file__).resolve().parents[1]


def _cuda_include() -> Path | None:
    for root in [Path("/usr/local/cuda/include")] + ([Path(shutil.which("nvcc")).parent.parent / "include"]
                                                       if shutil.which("nvcc") else []):
        if (root / "cuda.h").exists():
            return root
    return None


CUDA_INCLUDE = _cuda_include()
needs_cuda_h = pytest.mark.skipif(CUDA_INCLUDE is None or shutil.which("gcc") is None,
                                  reason="the CUDA toolkit's cuda.h and gcc are needed to build the stand-in driver")

# A stand-in for libcuda.so.1: cuLaunchKernelEx records what it was given, read through the
# real cuda.h types, so a field cuda-bindings or we put out of place shows as a wrong value.
# cuda-bindings finds the driver's functions through cuGetProcAddress (the rest stay NULL).
STAND_IN = r"""
#include <cuda.h>
#include <stddef.h>
#include <string.h>
static unsigned long long rec[32];
static int fail_with = 0;
void stand_in_fail(int code) { fail_with = code; }
const unsigned long long* stand_in_record(void) { return rec; }
CUresult cuLaunchKernelEx(const CUlaunchConfig* c, CUfunction f, void** params, void** extra) {
  memset(rec, 0, sizeof rec);
  rec[0] = c->gridDimX; rec[1] = c->gridDimY; rec[2] = c->gridDimZ;
  rec[3] = c->blockDimX; rec[4] = c->blockDimY; rec[5] = c->blockDimZ;
  rec[6] = c->sharedMemBytes; rec[7] = (unsigned long long)c->hStream; rec[8] = c->numAttrs;
  rec[9] = c->attrs[0].id; rec[10] = c->attrs[0].value.programmaticStreamSerializationAllowed;
  rec[11] = (unsigned long long)f; rec[12] = extra == 0;
  /* the test kernel's signature: (const float* p, int n, float x, long long m, double y) */
  rec[13] = *(unsigned long long*)params[0]; rec[14] = (unsigned long long)(long long)*(int*)params[1];
  float x = *(float*)params[2]; memcpy(&rec[15], &x, 4);
  rec[16] = (unsigned long long)*(long long*)params[3];
  double y = *(double*)params[4]; memcpy(&rec[17], &y, 8);
  return (CUresult)fail_with;
}
CUresult cuGetErrorName(CUresult e, const char** s) {
  *s = e == CUDA_ERROR_INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : "CUDA_ERROR_UNKNOWN";
  return CUDA_SUCCESS;
}
CUresult cuGetProcAddress(const char* symbol, void** fn, int version, cuuint64_t flags,
                          CUdriverProcAddressQueryResult* status) {
  *fn = !strcmp(symbol, "cuLaunchKernelEx") ? (void*)cuLaunchKernelEx
      : !strcmp(symbol, "cuGetErrorName") ? (void*)cuGetErrorName : NULL;
  if (status) *status = *fn ? CU_GET_PROC_ADDRESS_SUCCESS : CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND;
  return *fn ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}
"""


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory) -> Path:
    """A directory holding the stand-in as ``libcuda.so.1`` (its soname too)."""
    if CUDA_INCLUDE is None or shutil.which("gcc") is None:
        pytest.skip("the CUDA toolkit's cuda.h and gcc are needed to build the stand-in driver")
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    root = tmp_path_factory.mktemp("driver")
    (root / "driver.c").write_text(STAND_IN)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f"-I{CUDA_INCLUDE}", "-Wl,-soname,libcuda.so.1", "-o",
                    str(root / "libcuda.so.1"), str(root / "driver.c")], check=True, capture_output=True)
    return root


LAUNCH = """
import ctypes, json, sys
import numpy as np
from metrale_attn.backends import dependent_launch

function, grid, block, shared, stream, args, fail = json.loads(sys.argv[1])
driver = ctypes.CDLL("libcuda.so.1")  # the library path finds the stand-in, as it does for cuda-bindings
driver.stand_in_fail(fail)
driver.stand_in_record.restype = ctypes.POINTER(ctypes.c_ulonglong)
args = tuple(getattr(np, kind)(value) for kind, value in args)
try:
    dependent_launch.Driver().launch(function, grid, block, shared, stream, args, "decode_splitk_merge")
except RuntimeError as err:
    print(json.dumps({"error": str(err)}))
else:
    print(json.dumps({"record": driver.stand_in_record()[:18]}))
"""

ARGS = [("uint64", 0xDEAD_BEEF_0000_1230), ("int32", -7), ("float32", 1.5e-39), ("int64", -(2**40) - 3),
        ("float64", -2.25)]


def _launch_on_the_stand_in(stand_in: Path, function, grid, block, shared, stream, args=ARGS, fail=0) -> dict:
    """One dependent launch in a fresh interpreter whose library path finds the stand-in first:
    what the driver received (``record``) or the error raised (``error``)."""
    env = {**os.environ, "LD_LIBRARY_PATH": f"{stand_in}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    done = subprocess.run([sys.executable, "-c", LAUNCH, json.dumps([function, grid, block, shared, stream, args,
                                                                     fail])],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_cuda_h
def test_a_dependent_launch_gives_the_driver_its_geometry_stream_attribute_and_each_argument_by_value(stand_in):
    rec = _launch_on_the_stand_in(stand_in, 0x1234_5678, (132, 3, 2), (256, 1, 1), 213_248, 0xABCD_EF00)["record"]
    assert rec[:13] == [132, 3, 2, 256, 1, 1, 213_248, 0xABCD_EF00, 1, 6, 1, 0x1234_5678, 1]
    assert rec[13] == 0xDEAD_BEEF_0000_1230 and np.int64(np.uint64(rec[14])) == -7
    assert np.uint32(rec[15]).view(np.float32) == np.float32(1.5e-39)  # a subnormal, bit for bit
    assert np.uint64(rec[16]).view(np.int64) == -(2**40) - 3
    assert np.uint64(rec[17]).view(np.float64) == -2.25


@needs_cuda_h
def test_the_default_stream_reaches_the_driver_as_a_null_handle(stand_in):
    assert _launch_on_the_stand_in(stand_in, 1, (1, 1, 1), (128, 1, 1), 0, 0)["record"][7] == 0


@needs_cuda_h
def test_a_driver_error_is_raised_with_the_kernel_and_the_drivers_name_for_it(stand_in):
    error = _launch_on_the_stand_in(stand_in, 1, (1, 1, 1), (128, 1, 1), 0, 0, fail=1)["error"]
    assert re.fullmatch(r"decode_splitk_merge: cuLaunchKernelEx .* CUDA_ERROR_INVALID_VALUE \(1\)", error)


def test_an_argument_that_is_not_a_numpy_scalar_is_refused_before_the_driver_is_called():
    pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    with pytest.raises(TypeError, match="NumPy scalars"):
        dependent_launch.Driver().launch(1, (1, 1, 1), (128, 1, 1), 0, 0, (np.uint64(0), 5))


def test_only_devices_of_compute_capability_9_or_later_launch_dependents():
    assert [dependent_launch.supported(cc) for cc in ((8, 0), (8, 9), (9, 0), (10, 0), (12, 1))] == [
        False, False, True, True, True]


class _Function:
    ptr = 0x5150

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem):
        self.calls.append((grid, block, args, shared_mem))


def _launch(dependent: bool):
    from metrale_attn.backends import Launch

    return Launch("merge", (4, 2, 1), (128, 1, 1), 0, (np.uint64(8),), dependent)


def test_the_cupy_module_sends_a_dependent_launch_to_the_dependent_launcher_and_the_rest_to_cupy():
    function, dependent = _Function(), []
    module = _CupyModule({"merge": function}, lambda f, launch: dependent.append((f, launch)))
    module.launch(_launch(False))
    module.launch(_launch(True))
    assert function.calls == [((4, 2, 1), (128, 1, 1), (np.uint64(8),), 0)]
    assert dependent == [(function, _launch(True))]


def test_on_a_device_without_dependent_launch_a_dependent_launch_is_cupys_plain_launch():
    function = _Function()
    _CupyModule({"merge": function}, None).launch(_launch(True))
    assert len(function.calls) == 1


@pytest.mark.parametrize("impl, dependent_launch, merge_dependent", [
    ("mma", None, True), ("mma", False, False), ("simt", None, False)])
def test_only_the_mma_merge_is_launched_as_a_dependent_and_the_layer_can_turn_that_off(impl, dependent_launch,
                                                                                       merge_dependent):
    be = CountingBackend()
    options = {} if dependent_launch is None else {"dependent_launch": dependent_launch}
    attn = decoder(P, backend=be, splitk="3", impl=impl, **options)
    out, lse = run_poisoned(attn, P)
    assert [(launch.kernel, launch.dependent) for launch in be.launched] == [
        (f"{'simt_' if impl == 'simt' else ''}decode_splitk", False),
        (f"{'simt_' if impl == 'simt' else ''}decode_splitk_merge", merge_dependent)]
    check_against_reference(P, out, lse)


def test_the_bytes_are_the_same_with_and_without_the_dependent_launch():
    on = run_poisoned(decoder(P, splitk="3"), P)
    off = run_poisoned(decoder(P, splitk="3", dependent_launch=False), P)
    for a, b in zip(on, off):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("value, env, expected", [
    (None, None, True), (None, "", True), (None, " OFF ", False), (None, "0", False), (None, "yes", True),
    (False, "on", False), (True, "off", True)])
def test_the_dependent_launch_is_on_unless_the_argument_or_the_environment_turns_it_off(value, env, expected):
    assert config_module.resolve_dependent_launch(value, env) is expected


@pytest.mark.parametrize("value, env, named", [
    ("off", None, "dependent_launch"), (1, None, "dependent_launch"), (None, "maybe", "METRALE_ATTN_DECODE_PDL")])
def test_a_bad_dependent_launch_setting_is_refused_with_its_name(value, env, named):
    with pytest.raises(ValueError, match=named):
        config_module.resolve_dependent_launch(value, env)


def _function_body(ptx: str, name: str) -> str:
    start = ptx.index(f".entry {name}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:end if end > 0 else len(ptx)]


def test_on_sm_90_the_merge_waits_for_the_attention_grid_before_any_global_access_and_the_attention_grid_releases_it():
    ptx = nvrtc_ptx(KernelSpec("splitk", 128, "bf16", "fp8", "mma", 2))
    merge = _function_body(ptx, "decode_splitk_merge")
    first_global = re.search(r"\b(ld|st)\.global", merge)
    assert first_global and merge.index("griddepcontrol.wait") < first_global.start()
    attention = _function_body(ptx, "decode_splitk")
    assert attention.count("griddepcontrol.launch_dependents") == 1
    assert "griddepcontrol.wait" not in attention


def test_no_other_arm_and_no_architecture_before_sm_90_has_the_instructions():
    assert "griddepcontrol" not in nvrtc_ptx(KernelSpec("unpacked", 128, "bf16", "bf16", "mma", 2))
    assert "griddepcontrol" not in nvrtc_ptx(KernelSpec("splitk", 128, "bf16", "bf16", "mma", 2), "sm_80")
