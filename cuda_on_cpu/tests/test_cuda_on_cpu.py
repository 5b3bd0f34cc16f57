"""The CUDA-on-CPU shim: semantics, error reporting, thread orders, ASan, caching.

Toy kernels live in cuda_on_cpu/tests/toy_kernels/*.cu; each is compiled as a library
built on the shim compiles a kernel: the source with a `#line 1 "<path>"` directive in
front, so that errors name the real file and line. Nothing here imports metrale_attn
(tests/test_layering.py checks it).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest

from cuda_on_cpu import CudaOnCpuCompileError, CudaOnCpuError, Module, abi, asan, build, compile_module, environment

TOYS = Path(__file__).parent / "toy_kernels"
TOY_PATH = "cuda_on_cpu/tests/toy_kernels"
"""How the toys' ``#line`` directives name them: from the repository root."""

FULL = 0xFFFFFFFF


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path_factory.mktemp("cocpu-cache")))
        for var in ("METRALE_ATTN_CPU_ORDER", "METRALE_ATTN_CPU_FIBER", "METRALE_ATTN_CPU_STACK_KB"):
            mp.delenv(var, raising=False)
        yield


def toy_source(name: str) -> str:
    """toy_kernels/<name>.cu with a ``#line 1`` directive in front."""
    return f'#line 1 "{TOY_PATH}/{name}.cu"\n' + (TOYS / f"{name}.cu").read_text()


def toy(name: str, **kw):
    return compile_module(toy_source(name), name=name, **kw)


def line_of(name: str, needle: str) -> int:
    """1-based line of the first line of toy_kernels/<name>.cu containing needle."""
    for i, text in enumerate((TOYS / f"{name}.cu").read_text().splitlines(), 1):
        if needle in text:
            return i
    raise AssertionError(f"{needle!r} not in {name}.cu")


rng = np.random.default_rng(20240607)

needs_asan = pytest.mark.skipif(asan.libasan_path() is None, reason="the host compiler has no libasan.so")


# ---------------------------------------------------------------------------------------
# Semantics
# ---------------------------------------------------------------------------------------


def test_a_block_sum_with_shuffles_and_static_shared_memory_matches_numpy():
    mod = toy("block_reduce")
    assert mod.kernels == ("block_sum",)
    n = 1000
    x = rng.integers(-100, 100, size=n).astype(np.float32)  # integers: exact in any order
    out = np.full(8, np.nan, np.float32)
    mod.launch("block_sum", (8, 1, 1), (128, 1, 1), 0, (x, out, np.int32(n)))
    expect = np.add.reduceat(np.concatenate([x, np.zeros(24, np.float32)]), np.arange(0, 1024, 128))
    np.testing.assert_array_equal(out, expect)


def test_dynamic_shared_memory_reverses_each_block():
    mod = toy("dynamic_shared")
    x = rng.standard_normal(4 * 96).astype(np.float32)
    y = np.zeros_like(x)
    mod.launch("reverse_block", (4, 1, 1), (96, 1, 1), 96 * 4, (x, y))
    np.testing.assert_array_equal(y, x.reshape(4, 96)[:, ::-1].reshape(-1))


def test_uninitialized_dynamic_shared_memory_reads_the_poison():
    out = np.zeros(2 * 32, np.uint32)
    toy("dynamic_shared").launch("read_dynamic_uninitialized", (2, 1, 1), (32, 1, 1), 32 * 4, (out,))
    assert (out == 0xFFFFFFFF).all()


def test_static_shared_memory_is_poisoned_at_the_start_of_every_block():
    out = np.zeros(3 * 32, np.uint32)
    toy("dynamic_shared").launch("read_static_uninitialized", (3, 1, 1), (32, 1, 1), 0, (out,))
    np.testing.assert_array_equal(out[:32], np.arange(32))
    assert (out[32:] == 0xFFFFFFFF).all()


def shuffle_model(op: str, vals: np.ndarray, arg: int, width: int) -> np.ndarray:
    """What each lane of each 32-lane warp gets, per the CUDA programming guide."""
    out = np.empty_like(vals)
    for w in range(0, len(vals), 32):
        for lane in range(32):
            seg = lane // width * width
            if op == "idx":
                src = seg + arg % width
            elif op == "up":
                src = lane - arg if lane - seg >= arg else lane
            elif op == "down":
                src = lane + arg if lane - seg + arg < width else lane
            else:  # xor: later groups are out of reach, earlier ones are not
                src = lane ^ arg
                src = lane if src >= seg + width else src
            out[w + lane] = vals[w + src]
    return out


OPS = {"idx": 0, "up": 1, "down": 2, "xor": 3}


@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("width", [1, 2, 4, 8, 16, 32])
def test_each_shuffle_flavour_matches_a_numpy_model_of_lanes(op, width):
    mod = toy("shuffles")
    kernels = {"shfl_i32": np.int32, "shfl_u32": np.uint32, "shfl_f32": np.float32,
               "shfl_i64": np.int64, "shfl_f64": np.float64}
    for kernel, dtype in kernels.items():
        vals = (rng.permutation(64) * 1000 + 7).astype(dtype)
        if dtype == np.int64:
            vals = vals * (1 << 33) - 5  # the high word matters
        for arg in (0, 1, 3, 5, 16, 31):
            out = np.zeros_like(vals)
            mod.launch(kernel, (1, 1, 1), (64, 1, 1), 0,
                       (vals, out, np.int32(OPS[op]), np.int32(arg), np.int32(width)))
            np.testing.assert_array_equal(out, shuffle_model(op, vals, arg, width),
                                          err_msg=f"{kernel} {op} arg={arg} width={width}")


def test_a_shuffle_may_read_a_different_source_lane_in_every_lane():
    vals = rng.integers(0, 1 << 30, size=64).astype(np.int32)
    src = rng.integers(0, 32, size=64).astype(np.int32)
    out = np.zeros_like(vals)
    toy("shuffles").launch("shfl_per_lane_source", (1, 1, 1), (64, 1, 1), 0, (vals, src, out))
    np.testing.assert_array_equal(out, vals[np.arange(64) // 32 * 32 + src])


@pytest.mark.parametrize("density", [0.0, 0.3, 1.0])
def test_ballot_any_and_all_match_numpy(density):
    pred = (rng.random(128) < density).astype(np.int32) * rng.integers(1, 9, size=128).astype(np.int32)
    ballot, anyv, allv = np.zeros(128, np.uint32), np.zeros(128, np.int32), np.zeros(128, np.int32)
    toy("shuffles").launch("vote", (1, 1, 1), (128, 1, 1), 0, (pred, ballot, anyv, allv))
    for w in range(4):
        p = pred[w * 32:(w + 1) * 32] != 0
        bits = int(sum(1 << i for i in range(32) if p[i]))
        assert (ballot[w * 32:(w + 1) * 32] == bits).all()
        assert (anyv[w * 32:(w + 1) * 32] == int(p.any())).all()
        assert (allv[w * 32:(w + 1) * 32] == int(p.all())).all()


@pytest.mark.parametrize("density", [0.0, 0.5, 1.0])
def test_barrier_votes_count_and_or_over_the_block(density):
    pred = (rng.random(2 * 96) < density).astype(np.int32)
    count, alls, anys = (np.zeros_like(pred) for _ in range(3))
    toy("shuffles").launch("barrier_votes", (2, 1, 1), (96, 1, 1), 0, (pred, count, alls, anys))
    p = pred.reshape(2, 96) != 0
    np.testing.assert_array_equal(count.reshape(2, 96), np.repeat(p.sum(axis=1, keepdims=True), 96, axis=1))
    np.testing.assert_array_equal(alls.reshape(2, 96), np.repeat(p.all(axis=1, keepdims=True), 96, axis=1))
    np.testing.assert_array_equal(anys.reshape(2, 96), np.repeat(p.any(axis=1, keepdims=True), 96, axis=1))


def test_half_warps_may_shuffle_with_disjoint_masks():
    vals = np.arange(64, dtype=np.int32) * 3
    out = np.zeros_like(vals)
    toy("shuffles").launch("half_warp_masks", (1, 1, 1), (64, 1, 1), 0, (vals, out))
    np.testing.assert_array_equal(out, vals[np.arange(64) ^ 1])


def test_16_byte_float4_loads_and_stores():
    x = rng.standard_normal((100, 4)).astype(np.float32)
    y = np.zeros_like(x)
    toy("vector_io").launch("float4_axpb", (4, 1, 1), (32, 1, 1), 0, (x, y, np.int32(100)))
    np.testing.assert_array_equal(y, x * np.float32(2) + np.float32(1))


def test_16_byte_reinterpreted_uint4_loads_of_16_bit_data():
    x = rng.integers(0, 1 << 16, size=8 * 40).astype(np.uint16)
    y = np.zeros_like(x)
    toy("vector_io").launch("swap_halves_u16", (2, 1, 1), (32, 1, 1), 0, (x, y, np.int32(40)))
    np.testing.assert_array_equal(y, x.reshape(-1, 2)[:, ::-1].reshape(-1))


def test_8_byte_uint2_loads():
    x = rng.integers(0, 1 << 32, size=(50, 2), dtype=np.uint64).astype(np.uint32)
    y = np.zeros(50, np.uint64)
    toy("vector_io").launch("uint2_sum", (2, 1, 1), (32, 1, 1), 0, (x, y, np.int32(50)))
    np.testing.assert_array_equal(y, x.astype(np.uint64).sum(axis=1))


def _fiber_stack_guards() -> int:
    """Anonymous PROT_NONE mappings of 64 KiB in this process: the guards below fiber stacks
    (runtime/internal.h, kGuardBytes), one a stack."""
    count = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            count += len(fields) == 5 and fields[1] == "---p" and hi - lo == 64 * 1024
    return count


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps")
def test_only_the_library_that_launched_last_keeps_its_fiber_stacks_mapped():
    """Every library has its own pool of fiber stacks, two mappings a stack. A process that
    loads hundreds of libraries of 256-thread blocks (a test run) would reach vm.max_map_count
    if each kept its pool, and then cannot create a thread; so a launch first unmaps the pool
    of the library that launched before it."""
    a, b = toy("dynamic_shared"), toy("block_reduce")
    x = np.arange(1024, dtype=np.float32)
    y, out = np.empty_like(x), np.empty(8, np.float32)
    a.launch("reverse_block", (4, 1, 1), (256, 1, 1), 256 * 4, (x, y))
    after_a = _fiber_stack_guards()
    b.launch("block_sum", (8, 1, 1), (128, 1, 1), 0, (x, out, np.int32(1024)))
    after_b = _fiber_stack_guards()
    a.launch("reverse_block", (4, 1, 1), (256, 1, 1), 256 * 4, (x, y))
    assert after_a >= 256 and after_b == after_a - 128 and _fiber_stack_guards() == after_a
    np.testing.assert_array_equal(y, x.reshape(4, 256)[:, ::-1].ravel())  # a's stacks mapped again, and used


# ---------------------------------------------------------------------------------------
# Misuse is an error, not a hang
# ---------------------------------------------------------------------------------------


def misuse_error(kernel: str, block=(64, 1, 1), grid=(1, 1, 1), args=None) -> str:
    out = np.zeros(64, np.float32) if kernel.startswith("barrier") else np.zeros(64, np.int32)
    with pytest.raises(CudaOnCpuError) as e:
        toy("misuse").launch(kernel, grid, block, 0, args or (out,))
    return str(e.value)


def test_a_barrier_that_one_thread_skips_is_reported_with_its_block_and_thread():
    msg = misuse_error("barrier_skipped", grid=(3, 2, 1), args=(np.zeros(64, np.float32), np.int32(37)))
    line = line_of("misuse", "__syncthreads();")
    assert "kernel 'barrier_skipped' block (0,0,0)" in msg
    assert f"__syncthreads at {TOY_PATH}/misuse.cu:{line}" in msg
    assert "thread (37,0,0) has exited" in msg


def test_threads_waiting_at_different_barriers_are_reported_with_both_lines():
    msg = misuse_error("barrier_mismatch")
    src = (TOYS / "misuse.cu").read_text().splitlines()
    lines = [i for i, t in enumerate(src, 1) if t.strip() == "__syncthreads();"][1:3]  # barrier_mismatch's
    assert f"misuse.cu:{lines[0]}" in msg and f"misuse.cu:{lines[1]}" in msg, msg
    assert "kernel 'barrier_mismatch' block (0,0,0) thread (32,0,0)" in msg


def test_a_shuffle_whose_mask_names_an_exited_lane_is_reported():
    msg = misuse_error("shuffle_with_exited_lane", block=(32, 1, 1))
    assert "__shfl_xor_sync(mask=0xffffffff" in msg
    assert "lane 7 (thread (7,0,0)), which has exited" in msg


def test_lanes_that_call_different_warp_ops_are_reported():
    msg = misuse_error("lanes_disagree", block=(32, 1, 1))
    assert "disagree" in msg and "__shfl_down_sync" in msg and "__ballot_sync" in msg


def test_a_warp_op_in_a_partial_warp_is_an_error_naming_the_warp():
    msg = misuse_error("shuffle_in_partial_warp", block=(48, 1, 1))
    assert "partial warp" in msg and "48 threads" in msg and "thread (32,0,0)" in msg


def test_a_warp_op_whose_mask_leaves_out_the_calling_lane_is_an_error():
    msg = misuse_error("mask_without_self", block=(32, 1, 1))
    assert "does not include the calling lane 1" in msg and "thread (1,0,0)" in msg


def test_a_shuffle_reading_a_lane_outside_its_mask_is_an_error():
    msg = misuse_error("shuffle_source_outside_mask", block=(32, 1, 1))
    assert "reads lane 20, which is not in the mask 0x0000ffff" in msg


def test_trap_is_reported_with_its_thread_and_line():
    msg = misuse_error("traps", block=(32, 1, 1))
    assert f"__trap() at {TOY_PATH}/misuse.cu:{line_of('misuse', '__trap()')}" in msg
    assert "thread (3,0,0)" in msg


def test_the_module_lists_its_kernels_and_their_parameters():
    mod = toy("misuse")
    assert "takes_everything" in mod.kernels and "barrier_skipped" in mod.kernels
    params = mod.params("takes_everything")
    assert [p.name for p in params] == ["x", "y", "n", "u", "ll", "f", "vec"]
    assert [(p.kind, p.size) for p in params[2:6]] == [
        (abi.SIGNED, 4), (abi.UNSIGNED, 4), (abi.SIGNED, 8), (abi.FLOAT, 4)]
    assert params[0].pointee_const and not params[1].pointee_const
    assert params[6].pointee_size == 16 and params[6].pointee_align == 16


def everything_args(**override):
    args = dict(x=np.zeros(4, np.float32), y=np.zeros(4, np.uint16), n=np.int32(1), u=np.uint32(2),
                ll=np.int64(3), f=np.float32(4), vec=np.zeros((2, 4), np.uint32))
    args.update(override)
    return tuple(args.values())


def test_valid_arguments_of_every_kind_are_accepted():
    y = np.zeros(4, np.uint16)
    toy("misuse").launch("takes_everything", (1, 1, 1), (32, 1, 1), 0, everything_args(y=y))
    assert y[0] == 1 + 2 + 3 + 4 + 1
    toy("misuse").launch("takes_everything", (1, 1, 1), (32, 1, 1), 0, everything_args(vec=None))


def test_a_wrong_argument_count_is_an_error_naming_the_kernel():
    with pytest.raises(CudaOnCpuError, match=r"kernel 'takes_everything' takes 7 arguments .*got 6"):
        toy("misuse").launch("takes_everything", (1, 1, 1), (32, 1, 1), 0, everything_args()[:6])


@pytest.mark.parametrize("override, pattern", [
    (dict(n=5), r"parameter 2 'n' \(int\) expects numpy.int32, got Python int"),
    (dict(f=4.0), r"parameter 5 'f' \(float\) expects numpy.float32, got Python float"),
    (dict(n=np.int64(5)), r"parameter 2 'n' \(int\) expects numpy.int32, got numpy.int64"),
    (dict(u=np.int32(5)), r"parameter 3 'u' \(unsigned\) expects numpy.uint32, got numpy.int32"),
    (dict(ll=np.int32(5)), r"parameter 4 'll' \(long long\) expects numpy.int64, got numpy.int32"),
    (dict(f=np.int32(5)), r"parameter 5 'f' \(float\) expects numpy.float32, got numpy.int32"),
    (dict(n=np.zeros(1, np.int32)), r"parameter 2 'n' \(int\) expects a scalar \(numpy.int32\), got an array"),
    (dict(x=np.float32(1)), r"parameter 0 'x' \(const float\* __restrict__\) expects a NumPy array or None, got float32"),
    (dict(x=[1.0, 2.0]), r"parameter 0 'x' .* expects a NumPy array or None, got list"),
    (dict(y=np.zeros((4, 4), np.uint16)[:, 0]), r"parameter 1 'y' \(unsigned short\*\): the array must be C-contiguous"),
    (dict(vec=np.zeros(9, np.uint32)[1:]), r"parameter 6 'vec' \(const uint4\*\): array data is not 16-byte aligned"),
])
def test_an_argument_mismatch_is_an_error_naming_the_kernel_and_the_parameter(override, pattern):
    with pytest.raises(CudaOnCpuError, match="kernel 'takes_everything' " + pattern):
        toy("misuse").launch("takes_everything", (1, 1, 1), (32, 1, 1), 0, everything_args(**override))


def test_a_read_only_array_for_a_non_const_pointer_is_an_error():
    y = np.zeros(4, np.uint16)
    y.flags.writeable = False
    with pytest.raises(CudaOnCpuError, match="parameter 1 'y' .*read-only array"):
        toy("misuse").launch("takes_everything", (1, 1, 1), (32, 1, 1), 0, everything_args(y=y))


@pytest.mark.parametrize("kernel, grid, block, shared, pattern", [
    ("block_sum", (1, 1, 1), (256, 1, 1), 0, r"exceeds __launch_bounds__\(128\)"),
    ("block_sum", (1, 1, 1), (128, 1, 1), 228 * 1024, r"exceed the 227 KiB"),
    ("block_sum", (1, 1, 1), (2048, 1, 1), 0, r"invalid block"),
    ("block_sum", (0, 1, 1), (128, 1, 1), 0, r"grid .*: out of range"),
    ("no_such_kernel", (1, 1, 1), (128, 1, 1), 0, r"has no kernel 'no_such_kernel'"),
])
def test_an_impossible_launch_configuration_is_an_error(kernel, grid, block, shared, pattern):
    x, out = np.zeros(128, np.float32), np.zeros(1, np.float32)
    with pytest.raises(CudaOnCpuError, match=pattern):
        toy("block_reduce").launch(kernel, grid, block, shared, (x, out, np.int32(128)))


# ---------------------------------------------------------------------------------------
# Thread orders
# ---------------------------------------------------------------------------------------


def race_run(order: str) -> bytes:
    x = np.arange(4 * 64, dtype=np.float32)
    out = np.zeros_like(x)
    toy("races").launch("racy_overwrite", (4, 1, 1), (64, 1, 1), 0, (x, out), order=order)
    return out.tobytes()


def test_the_planted_shared_memory_race_is_caught_by_warp_ahead_but_not_by_default():
    base = race_run("default")
    assert race_run("default") == base  # deterministic
    # Warp 1 reaches its write five shuffle rounds after warp 0's read: reversing or
    # shuffling threads within rounds cannot expose it.
    assert race_run("reverse") == base
    assert all(race_run(f"shuffle:{seed}") == base for seed in range(5))
    caught = [seed for seed in range(20) if race_run(f"warp-ahead:{seed}") != base]
    assert caught, "no warp-ahead seed exposed the race"


@pytest.mark.parametrize("order", ["reverse", "shuffle:1", "shuffle:2", "shuffle:3",
                                   "warp-ahead:1", "warp-ahead:2", "warp-ahead:3", "warp-ahead:4"])
def test_a_race_free_kernel_gives_identical_bytes_under_every_order(order):
    mod = toy("block_reduce")
    x = rng.standard_normal(16 * 128).astype(np.float32)  # non-integers: order would show
    ref, out = np.zeros(16, np.float32), np.zeros(16, np.float32)
    mod.launch("block_sum", (16, 1, 1), (128, 1, 1), 0, (x, ref, np.int32(x.size)), order="default")
    mod.launch("block_sum", (16, 1, 1), (128, 1, 1), 0, (x, out, np.int32(x.size)), order=order)
    assert out.tobytes() == ref.tobytes()


def arrival(order=None, block=64) -> np.ndarray:
    counter, seen = np.zeros(1, np.uint32), np.zeros(block, np.uint32)
    toy("races").launch("arrival_order", (1, 1, 1), (block, 1, 1), 0, (counter, seen), order=order)
    return seen


def test_the_order_policies_decide_the_thread_order(monkeypatch):
    n = 64
    np.testing.assert_array_equal(arrival("default"), np.arange(n))
    np.testing.assert_array_equal(arrival("reverse"), np.arange(n)[::-1])
    shuffled = arrival("shuffle:7")
    assert sorted(shuffled) == list(range(n)) and not (shuffled == np.arange(n)).all()
    np.testing.assert_array_equal(arrival("shuffle:7"), shuffled)  # seeded
    ahead = arrival("warp-ahead:3")
    assert sorted(ahead) == list(range(n))
    # Warps are units: each warp's lanes pass consecutively, in lane order.
    for w in range(2):
        lanes = ahead[w * 32:(w + 1) * 32]
        np.testing.assert_array_equal(lanes, lanes[0] + np.arange(32))
    monkeypatch.setenv("METRALE_ATTN_CPU_ORDER", "reverse")
    np.testing.assert_array_equal(arrival(None), np.arange(n)[::-1])


@pytest.mark.parametrize("order", ["sideways", "shuffle", "shuffle:", "shuffle:x", "warp-ahead:-1", "Default"])
def test_an_unknown_order_spelling_is_a_value_error(order):
    with pytest.raises(ValueError, match="unknown thread order"):
        arrival(order)


# ---------------------------------------------------------------------------------------
# AddressSanitizer, crashes, isolation
# ---------------------------------------------------------------------------------------


@needs_asan
def test_asan_reports_an_out_of_bounds_read_of_an_input_array_with_its_cu_line():
    mod = toy("oob", asan=True)
    x, out = np.zeros(64, np.float32), np.zeros(64, np.float32)
    mod.launch("read_past_input", (1, 1, 1), (64, 1, 1), 0, (x, out, np.int32(0)))  # in bounds: fine
    with pytest.raises(CudaOnCpuError) as e:
        mod.launch("read_past_input", (1, 1, 1), (64, 1, 1), 0, (x, out, np.int32(1)))
    msg = str(e.value)
    assert "heap-buffer-overflow" in msg
    assert f"{TOY_PATH}/oob.cu:{line_of('oob', '= x[threadIdx.x + shift]')}" in msg
    assert "kernel 'read_past_input' block (0,0,0) thread (63,0,0)" in msg


@needs_asan
def test_asan_reports_an_out_of_bounds_read_of_a_static_shared_array_with_its_cu_line():
    mod = toy("oob", asan=True)
    with pytest.raises(CudaOnCpuError) as e:
        mod.launch("read_past_shared", (1, 1, 1), (64, 1, 1), 0, (np.zeros(64, np.float32), np.int32(1)))
    msg = str(e.value)
    assert "global-buffer-overflow" in msg
    assert f"{TOY_PATH}/oob.cu:{line_of('oob', '= s[threadIdx.x + shift]')}" in msg


@needs_asan
def test_asan_reports_an_out_of_bounds_read_of_dynamic_shared_memory():
    mod = toy("oob", asan=True)
    with pytest.raises(CudaOnCpuError) as e:
        mod.launch("read_past_dynamic", (1, 1, 1), (64, 1, 1), 64 * 4, (np.zeros(64, np.float32), np.int32(1)))
    assert "heap-buffer-overflow" in str(e.value)
    assert f"{TOY_PATH}/oob.cu:{line_of('oob', '= buf[threadIdx.x + shift]')}" in str(e.value)


@needs_asan
@pytest.mark.skipif(shutil.which("addr2line") is None, reason="no addr2line")
def test_an_unsymbolized_asan_report_gets_the_cu_line_from_addr2line(monkeypatch):
    monkeypatch.setenv("ASAN_OPTIONS", "symbolize=0")  # appended last: overrides the loader's
    mod = toy("oob", asan=True)
    with pytest.raises(CudaOnCpuError) as e:
        mod.launch("read_past_input", (1, 1, 1), (64, 1, 1), 0,
                   (np.zeros(64, np.float32), np.zeros(64, np.float32), np.int32(1)))
    msg = str(e.value)
    assert "addr2line (" in msg
    assert f"{TOY_PATH}/oob.cu:{line_of('oob', '= x[threadIdx.x + shift]')}" in msg


@needs_asan
def test_asan_and_isolated_launches_copy_the_arrays_back():
    x = rng.integers(-50, 50, size=3 * 128).astype(np.float32)
    for kw in (dict(asan=True), dict()):
        out = np.zeros(3, np.float32)
        toy("block_reduce", **kw).launch("block_sum", (3, 1, 1), (128, 1, 1), 0, (x, out, np.int32(x.size)),
                                         isolate=True)
        np.testing.assert_array_equal(out, x.reshape(3, 128).sum(axis=1))
    # Launch errors come back from the child as the same CudaOnCpuError.
    with pytest.raises(CudaOnCpuError, match=r"thread \(37,0,0\) has exited"):
        toy("misuse").launch("barrier_skipped", (1, 1, 1), (64, 1, 1), 0, (np.zeros(64, np.float32), np.int32(37)),
                             isolate=True)


def test_a_stack_overflow_in_an_isolated_launch_is_an_error_not_a_crash():
    with pytest.raises(CudaOnCpuError) as e:
        toy("stack_overflow").launch("overflow_stack", (1, 1, 1), (32, 1, 1), 0, (np.zeros(32, np.float32),),
                                     isolate=True)
    msg = str(e.value)
    assert "crashed" in msg and "fiber stack overflow" in msg
    assert "kernel 'overflow_stack' block (0,0,0) thread (0,0,0)" in msg


def test_an_in_process_stack_overflow_is_loud():
    toy("stack_overflow")  # compiled (and cached) here; the child only loads it
    code = (
        "import numpy as np\n"
        "from cuda_on_cpu import compile_module\n"
        f"src = {toy_source('stack_overflow')!r}\n"
        "mod = compile_module(src, name='stack_overflow')\n"
        "mod.launch('overflow_stack', (1, 1, 1), (32, 1, 1), 0, (np.zeros(32, np.float32),))\n"
    )
    r = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code], capture_output=True, text=True,
                       env=dict(os.environ))
    assert r.returncode != 0
    assert "cuda_on_cpu: fiber stack overflow" in r.stderr
    assert "Fatal Python error: Segmentation fault" in r.stderr  # faulthandler took over


def test_the_ucontext_fallback_gives_the_same_results(monkeypatch):
    x = rng.standard_normal(4 * 128).astype(np.float32)
    ref, out = np.zeros(4, np.float32), np.zeros(4, np.float32)
    toy("block_reduce").launch("block_sum", (4, 1, 1), (128, 1, 1), 0, (x, ref, np.int32(x.size)))
    monkeypatch.setenv("METRALE_ATTN_CPU_FIBER", "ucontext")
    mod = toy("block_reduce")
    mod.launch("block_sum", (4, 1, 1), (128, 1, 1), 0, (x, out, np.int32(x.size)))
    assert out.tobytes() == ref.tobytes()
    msg = misuse_error("barrier_skipped", args=(np.zeros(64, np.float32), np.int32(3)))
    assert "thread (3,0,0) has exited" in msg


# ---------------------------------------------------------------------------------------
# Building and caching
# ---------------------------------------------------------------------------------------


def test_a_second_compile_of_the_same_source_does_not_run_the_compiler(monkeypatch):
    src = toy_source("block_reduce") + "\n// cache test\n"
    first = compile_module(src, name="cache_probe")
    calls = len(build.compiler_calls)
    assert compile_module(src, name="cache_probe") is first  # in-process memo
    monkeypatch.setattr(build, "_MEMO", {})  # a fresh process: only the disk cache is left
    again = compile_module(src, name="cache_probe")
    assert again is not first and again.path == first.path
    assert len(build.compiler_calls) == calls
    x, out = np.ones(128, np.float32), np.zeros(1, np.float32)
    again.launch("block_sum", (1, 1, 1), (128, 1, 1), 0, (x, out, np.int32(128)))
    assert out[0] == 128
    # Another define is another library.
    compile_module(src, name="cache_probe", defines={"UNUSED_KNOB": 1})
    assert len(build.compiler_calls) > calls


def _damage(kind: str, so: Path, meta: Path, other: Module) -> None:
    """Damage a cached library. Files are replaced, never rewritten in place: this process
    has the library mapped, and shrinking a mapped file would fault here too."""

    def replace(path: Path, data: bytes) -> None:
        tmp = path.with_name(path.name + ".damage")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    if kind == "truncated .so":  # dlopen maps past the end of the file: SIGBUS
        replace(so, so.read_bytes()[: so.stat().st_size // 2])
    elif kind == "empty .so":
        replace(so, b"")
    elif kind == "another variant's .so":  # a foreign kernel table under this name: SIGSEGV
        replace(so, other.path.read_bytes())
    elif kind == "garbage .json":
        replace(meta, b"{not json")
    elif kind == "another variant's .so and .json":  # a consistent pair, of the wrong variant
        replace(so, other.path.read_bytes())
        replace(meta, other.path.with_suffix(".json").read_bytes())
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["truncated .so", "empty .so", "another variant's .so", "garbage .json",
                                  "another variant's .so and .json"])
def test_a_damaged_cached_library_is_rebuilt_instead_of_crashing_the_process(kind):
    src = toy_source("block_reduce") + f"\n// damaged cache: {kind}\n"
    good = compile_module(src, name="damaged")
    _damage(kind, good.path, good.path.with_suffix(".json"), toy("dynamic_shared"))
    code = (  # a fresh process, so only the disk cache is left; a crash must not take pytest with it
        "import numpy as np\n"
        "from cuda_on_cpu import build, compile_module\n"
        f"mod = compile_module({src!r}, name='damaged')\n"
        "x, out = np.ones(128, np.float32), np.zeros(1, np.float32)\n"
        "mod.launch('block_sum', (1, 1, 1), (128, 1, 1), 0, (x, out, np.int32(128)))\n"
        "print(out[0], len(build.compiler_calls) > 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert (r.returncode, r.stdout.split()) == (0, ["128.0", "True"]), r.stderr
    record = json.loads(good.path.with_suffix(".json").read_text())["library"]  # healed on disk too
    assert record["bytes"] == good.path.stat().st_size and record["name"] == "damaged"


def _read_only(directory: Path, monkeypatch) -> None:
    """Make ``directory`` read-only; for root, whom permission bits do not stop, creating
    a file in it also fails the way it would for anyone else."""
    directory.chmod(0o555)
    if os.geteuid() == 0:
        real = tempfile.mkstemp

        def refusing(*args, dir=None, **kwargs):
            if dir is not None and Path(dir).resolve() == directory.resolve():
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
            return real(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", refusing)


def _fresh_process(monkeypatch) -> None:
    for name, value in (("_MEMO", {}), ("_FALLBACK_DIRS", {}), ("_FALLBACK_WARNED", False)):
        monkeypatch.setattr(build, name, value)


@pytest.mark.parametrize("how", ["a file stands where the directory should be", "read-only directory"])
def test_an_unwritable_cache_directory_falls_back_to_a_private_temporary_one_with_one_warning(
        how, tmp_path, monkeypatch):
    if how == "read-only directory":
        root = tmp_path / "cache"
        (root / "cuda_on_cpu").mkdir(parents=True)
        _read_only(root / "cuda_on_cpu", monkeypatch)
    else:
        root = tmp_path / "a-file"
        root.write_text("")
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(root / "cuda_on_cpu"))
    _fresh_process(monkeypatch)
    with pytest.warns(build.CacheFallbackWarning) as caught:
        mods = [toy("block_reduce"), toy("dynamic_shared")]
    assert len(caught) == 1 and str(root) in str(caught[0].message)
    assert mods[0].path.parent == mods[1].path.parent != root / "cuda_on_cpu"
    x, out = np.ones(128, np.float32), np.zeros(1, np.float32)
    mods[0].launch("block_sum", (1, 1, 1), (128, 1, 1), 0, (x, out, np.int32(128)))
    assert out[0] == 128


def test_a_cache_directory_that_fills_up_mid_build_falls_back_to_a_private_one_with_a_warning_naming_it(
        tmp_path, monkeypatch):
    """No space left (or over quota) while a library is written: not a bare OSError without a
    path, but the same fallback as a read-only cache, the warning naming the directory."""
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path))
    _fresh_process(monkeypatch)
    configured = build.environment.cache_dir()
    real = build._build

    def full_disk(source, name, cxx, flags, dflags, fiber, asan, so_path, meta_path, identity):
        if so_path.parent.resolve() == configured.resolve():
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(so_path.parent / "build-x"))
        return real(source, name, cxx, flags, dflags, fiber, asan, so_path, meta_path, identity)

    monkeypatch.setattr(build, "_build", full_disk)
    with pytest.warns(build.CacheFallbackWarning) as caught:
        mod = compile_module(toy_source("block_reduce") + "\n// a full disk\n", name="full_disk")
    assert len(caught) == 1 and str(configured) in str(caught[0].message)
    assert "No space left on device" in str(caught[0].message) and mod.path.parent != configured
    x, out = np.ones(128, np.float32), np.zeros(1, np.float32)
    mod.launch("block_sum", (1, 1, 1), (128, 1, 1), 0, (x, out, np.int32(128)))
    assert out[0] == 128


@pytest.mark.parametrize("damage", ["truncated"])  # each case recompiles the runtime (~3 s): one stands for all
def test_a_damaged_cached_runtime_object_is_rebuilt_rather_than_failing_every_later_link(damage, tmp_path,
                                                                                        monkeypatch):
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path))
    _fresh_process(monkeypatch)
    toy("block_reduce")
    objects = sorted(build.environment.cache_dir().glob("runtime-*.o"))
    assert objects and all(obj.with_name(obj.name + ".json").exists() for obj in objects)
    obj = objects[0]
    if damage == "record missing":
        obj.with_name(obj.name + ".json").unlink()
    else:  # an object file is only read by the linker: rewriting it in place is safe
        obj.write_bytes(obj.read_bytes()[:100] if damage == "truncated" else b"")
    _fresh_process(monkeypatch)
    mod = compile_module(toy_source("block_reduce") + "\n// after the damage\n", name="after_damage")
    x, out = np.ones(128, np.float32), np.zeros(1, np.float32)
    mod.launch("block_sum", (1, 1, 1), (128, 1, 1), 0, (x, out, np.int32(128)))
    assert out[0] == 128 and obj.stat().st_size > 100


def test_the_default_cache_directory_is_the_shims_own(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path / "set"))
    assert environment.cache_dir() == tmp_path / "set"
    monkeypatch.delenv("CUDA_ON_CPU_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert environment.cache_dir() == tmp_path / "xdg" / "cuda-on-cpu"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert environment.cache_dir() == Path.home() / ".cache" / "cuda-on-cpu"


def test_a_library_built_on_the_shim_gives_its_own_cache_directory_setting_and_logger(tmp_path, monkeypatch, caplog):
    """Its users then see one cache and one logger: builds, cache hits and fallbacks are logged
    on its logger, and the fallback warning names the setting they change."""
    theirs = logging.getLogger("a_library")
    src = toy_source("block_reduce") + "\n// a library's\n"

    def build_for_the_library(cache_dir: Path) -> Module:
        _fresh_process(monkeypatch)
        return compile_module(src, name="a_library", cache_dir=cache_dir, cache_setting="A_LIBRARY_CACHE",
                              logger=theirs)

    its_cache = environment.cache_dir()  # this module's, whose runtime objects are built already
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path / "not-the-librarys"))
    with caplog.at_level(logging.DEBUG, logger="a_library"):
        mod = build_for_the_library(its_cache)
        assert build_for_the_library(its_cache).path == mod.path
    assert mod.path.parent == its_cache and not (tmp_path / "not-the-librarys").exists()
    assert [r.getMessage().split()[0] for r in caplog.records if r.name == "a_library"] == ["compiled", "loaded"]
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with caplog.at_level(logging.WARNING, logger="a_library"), pytest.warns(build.CacheFallbackWarning) as caught:
        build_for_the_library(blocker / "cache")
    assert "(point A_LIBRARY_CACHE at a writable directory with space to keep them)" in str(caught[0].message)
    assert [r.levelno for r in caplog.records if r.name == "a_library"][-1] == logging.WARNING


def test_valid_libraries_in_a_read_only_cache_are_used_without_a_rebuild_or_a_warning(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path))
    _fresh_process(monkeypatch)
    built = toy("block_reduce")
    _read_only(built.path.parent, monkeypatch)
    _fresh_process(monkeypatch)
    calls = len(build.compiler_calls)
    with warnings.catch_warnings():
        warnings.simplefilter("error", build.CacheFallbackWarning)
        again = toy("block_reduce")
    assert again.path == built.path and len(build.compiler_calls) == calls


def test_a_bad_stack_size_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_CPU_STACK_KB", "abc")
    with pytest.raises(ValueError, match="METRALE_ATTN_CPU_STACK_KB must be a whole number of KiB >= 16, got 'abc'"):
        toy("block_reduce").launch("block_sum", (1, 1, 1), (128, 1, 1), 0,
                                   (np.ones(128, np.float32), np.zeros(1, np.float32), np.int32(128)))


def test_a_compile_error_names_the_cu_file_and_line():
    with pytest.raises(CudaOnCpuCompileError) as e:
        toy("compile_error")
    line = line_of("compile_error", "undeclared_identifier")
    assert f"{TOY_PATH}/compile_error.cu:{line}" in str(e.value)
    assert "undeclared_identifier" in str(e.value)


def test_only_the_kernels_that_the_defines_select_are_registered():
    src = (
        '#line 1 "kernels_cu/select.cu"\n'
        "#define KERNEL extern \"C\" __global__\n"
        "#if WITH_B\n"
        "KERNEL void __launch_bounds__(64) b(float* out) { out[threadIdx.x] = 2.0f; }\n"
        "#endif\n"
        "/* extern \"C\" __global__ void in_a_comment(int x) {} */\n"
        "extern \"C\" __global__ void a(float* out, const int* __restrict__ p, long long n);\n"
        "extern \"C\" __global__ void a(float* out, const int* __restrict__ p, long long n) { out[0] = 1.0f; }\n"
    )
    assert compile_module(src, name="select", defines={"WITH_B": 0}).kernels == ("a",)
    mod = compile_module(src, name="select", defines={"WITH_B": 1})
    assert sorted(mod.kernels) == ["a", "b"]
    assert [p.name for p in mod.params("a")] == ["out", "p", "n"]
    with pytest.raises(CudaOnCpuError, match=r"__launch_bounds__\(64\)"):
        mod.launch("b", (1, 1, 1), (128, 1, 1), 0, (np.zeros(128, np.float32),))


def test_a_preprocessor_error_names_the_cu_file_and_line():
    src = '#line 1 "kernels_cu/needs_define.cu"\n#ifndef HEAD_DIM\n#error "HEAD_DIM must be defined"\n#endif\n'
    with pytest.raises(CudaOnCpuCompileError, match=r"kernels_cu/needs_define.cu:2.*HEAD_DIM must be defined"):
        compile_module(src, name="needs_define")


# ---------------------------------------------------------------------------------------
# The same sources build with NVRTC
# ---------------------------------------------------------------------------------------

NVRTC_TOYS = sorted(p.stem for p in TOYS.glob("*.cu") if p.stem != "compile_error")


@pytest.mark.parametrize("name", NVRTC_TOYS)
def test_the_toy_kernels_compile_with_nvrtc_for_sm_90(name):
    nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    try:
        prog = nvrtc.createProgram(toy_source(name), f"{name}.cu", [], [])
    except Exception as e:  # the NVRTC library itself is missing
        pytest.skip(f"NVRTC unavailable: {e}")
    opts = ["--gpu-architecture=sm_90", "-std=c++17", "-DDYNAMIC_SHARED(T,name)=extern __shared__ __align__(16) T name[]"]
    try:
        nvrtc.compileProgram(prog, opts)
    except Exception as e:
        pytest.fail(f"NVRTC rejected {name}.cu: {e}\n{nvrtc.getProgramLog(prog)}")
    finally:
        nvrtc.destroyProgram(prog)


@pytest.mark.parametrize("grid, block, message", [
    ((1, 65536, 1), (128, 1, 1), r"invalid grid \(1, 65536, 1\): out of range"),
    ((1, 1, 65536), (128, 1, 1), r"invalid grid \(1, 1, 65536\): out of range"),
    ((1, 1, 1), (1025, 1, 1), r"invalid block \(1025, 1, 1\): out of range"),
    ((1, 1, 1), (32, 1, 65), r"invalid block \(32, 1, 65\): out of range"),
    ((1, 1, 1), (512, 4, 1), r"invalid block \(512, 4, 1\): 2048 threads"),
])
def test_a_launch_a_gpu_would_refuse_is_refused_on_the_cpu_too(grid, block, message):
    """CUDA's grid and block limits, so that CI sees what a GPU would refuse."""
    mod = toy("block_reduce")
    x, out = np.ones(128, np.float32), np.zeros(1, np.float32)
    with pytest.raises(CudaOnCpuError, match=message):
        mod.launch("block_sum", grid, block, 0, (x, out, np.int32(128)))
