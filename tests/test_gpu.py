"""What only a CUDA device has, through CuPy; skipped cleanly where there is none. The
correctness cases (every arm, dtype, head dim, layout and page size, heads_per_cta bytes, the
packed arm, the features, merge_states, batch invariance, the known-answer self-test) are the
CPU tests' own, run on the device by the ``backend`` fixture (conftest.py) from their files;
``pytest -m gpu tests/`` selects those runs and this file. Here: the device's description; the
device against the CPU backend (decode, merge_states); every feature at once on multi-token
rows (the CPU suite meets that combination in its fuzz only); torch CUDA tensors and the custom
op, CUDA graphs, streams, the benchmark timer; the PTX toys on the device."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import tolerance
from metrale_attn.backends import DeviceInfo, get_backend
from metrale_attn.config import IMPLS
from metrale_attn.problems import Problem

from support import ptx_toys
from support.backends import ON_GPU, device_array
from support.problems import ARM_OPTIONS, check_against_reference, decoder, problem, run_poisoned

pytestmark = list(ON_GPU)


def _heads(arm):
    return dict(num_q_heads=24, num_kv_heads=4) if arm == "gqa_packed" else dict(num_q_heads=8, num_kv_heads=2)


def test_the_cupy_backend_describes_its_device_by_name_and_the_target_takes_its_sm_count():
    import cupy

    device = get_backend("cupy").device()
    assert isinstance(device, DeviceInfo) and device.ordinal == cupy.cuda.Device().id and device.name
    props = cupy.cuda.runtime.getDeviceProperties(device.ordinal)
    assert device.compute_capability == (props["major"], props["minor"])
    assert device.sm_count == props["multiProcessorCount"]
    attn = decoder(problem(), backend="cupy", target="hopper")
    assert attn.target_policy.sm_count == device.sm_count


def _cross_checks():
    for impl in IMPLS:
        for arm in ARM_OPTIONS:
            for kv in ("bf16", "fp16", "fp8") + (("fp8_e5m2",) if impl == "mma" else ()):
                yield pytest.param(impl, arm, kv, id=f"{impl}-{arm}-kv{kv}")


@pytest.mark.parametrize("impl, arm, kv", list(_cross_checks()))
def test_every_arm_on_the_gpu_is_within_one_ulp_and_matches_the_cpu_backend(impl, arm, kv):
    page_size, head_dim = 16, 256 if arm == "gqa_packed" else 128
    lengths = (0, 1, page_size, 2 * page_size + 1, 300, 2049)
    p = problem(seed=head_dim, head_dim=head_dim, page_size=page_size, seq_lens=lengths, kv_dtype=kv, q_dtype="bf16",
                layout="NHD", share_prefix_pages=1, **_heads(arm))
    gpu = decoder(p, backend="cupy", impl=impl, **ARM_OPTIONS[arm])
    assert (gpu.plan(len(lengths)).arm, gpu.plan(len(lengths)).impl) == (arm, impl)
    out, lse = run_poisoned(gpu, p)
    check_against_reference(p, out, lse)
    cpu_out, _ = run_poisoned(decoder(p, backend="cpu", impl=impl, **ARM_OPTIONS[arm]), p)
    # each within 1 ulp of the reference; downstream of an MMA the two may round apart
    assert tolerance.ulp_distance(out, cpu_out).max() <= (1 if impl == "simt" else 2)


@pytest.mark.parametrize("options", [dict(splitk="off"), dict(splitk="auto")], ids=["unpacked", "splitk"])
def test_the_features_on_the_gpu_match_the_reference(options):
    """Every feature at once on multi-token rows: the CPU suite meets this combination only in
    its fuzz (test_features.py), which stays on the CPU (a backend parameter would re-draw its
    examples)."""
    p = problem(seed=23, page_size=16, seq_lens=(0, 5, 700, 2100), num_q_heads=8, num_kv_heads=2, head_dim=128,
                kv_dtype="fp8")
    sinks = np.random.default_rng(0).normal(0, 2, 8).astype(np.float32)
    q = np.random.default_rng(1).standard_normal((4, 3, 8, 128)).astype(p.q.dtype)
    attn = decoder(p, backend="cupy", max_q_len=3, window_left=300, logits_soft_cap=30.0, sinks=True, **options)
    out, lse = run_poisoned(attn, p, q=q, sinks=sinks)
    ref, ref_lse = p.reference(return_lse=True, q=q, window_left=300, logits_soft_cap=30.0, sinks=sinks)
    tolerance.assert_close_to_reference(out, ref, v_absmax=p.v_absmax())
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


def test_merge_states_on_the_gpu_gives_the_cpu_backends_state_within_fp32_rounding():
    import cupy

    from metrale_attn import merge_states

    rng = np.random.default_rng(2)
    v_a, v_b = (rng.standard_normal((16, 8, 128)).astype(np.float32) for _ in range(2))
    s_a, s_b = (rng.normal(0, 2, (16, 8)).astype(np.float32) for _ in range(2))
    s_a[0] = -np.inf
    gpu = merge_states(*(cupy.asarray(x) for x in (v_a, s_a, v_b, s_b)))
    cpu = merge_states(v_a, s_a, v_b, s_b)
    np.testing.assert_allclose(cupy.asnumpy(gpu[0]), cpu[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(cupy.asnumpy(gpu[1]), cpu[1], rtol=1e-6, atol=1e-6)


def _torch_inputs(torch, p):
    """q, k, v (bf16), block_tables, seq_lens as torch CUDA tensors."""
    bf16 = lambda a: torch.from_numpy(a.view(np.int16)).view(torch.bfloat16).cuda()
    return (bf16(p.q), bf16(p.k_cache), bf16(p.v_cache), torch.from_numpy(p.block_tables).cuda(),
            torch.from_numpy(p.seq_lens).cuda())


def _to_numpy_bf16(torch, t, like):
    return t.view(torch.int16).cpu().numpy().view(like.dtype)


def test_torch_tensors_go_in_and_come_out_without_copies():
    torch = pytest.importorskip("torch")
    p = problem(seed=2, page_size=16, seq_lens=(100, 1000), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    out, lse = attn.run(q, k, v, bt, sl, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16 and out.device == q.device
    check_against_reference(p, _to_numpy_bf16(torch, out, p.q), lse.cpu().numpy())


def test_torch_inputs_launch_on_torchs_current_stream_so_a_torch_graph_captures_them():
    torch = pytest.importorskip("torch")
    p = problem(seed=6, page_size=16, seq_lens=(700, 5), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", splitk="4")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    attn.run(q, k, v, bt, sl, out=out, lse=lse)  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # captures on a side stream it makes current
        attn.run(q, k, v, bt, sl, out=out, lse=lse)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(p, _to_numpy_bf16(torch, out, p.q), lse.cpu().numpy())


def test_a_captured_cuda_graph_replays_with_seq_lens_changed_in_place():
    import cupy

    p = problem(seed=4, page_size=16, seq_lens=(600, 40, 1), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", splitk="auto")
    q, k, v, bt, sl = (device_array(a) for a in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens))
    out = cupy.empty(p.q.shape, dtype=p.q.dtype)
    lse = cupy.empty(p.q.shape[:2], dtype=np.float32)
    attn.run(q, k, v, bt, sl, out=out, lse=lse)  # warm up outside capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        attn.run(q, k, v, bt, sl, out=out, lse=lse)
        graph = stream.end_capture()
    shorter = np.array([300, 39, 0], np.int32)
    sl.set(shorter)
    out.set(np.full(p.q.shape, np.nan, dtype=p.q.dtype))
    cupy.cuda.Device().synchronize()  # the graph's stream does not wait on the null stream
    graph.launch(stream)
    stream.synchronize()
    changed = Problem(p.q, p.k_cache, p.v_cache, p.block_tables, shorter, p.k_scale, p.v_scale,
                      p.kv_layout)
    check_against_reference(changed, cupy.asnumpy(out), cupy.asnumpy(lse))


@pytest.mark.parametrize("impl", ["simt", "mma"])
def test_the_benchmark_timer_captures_torch_inputs_on_its_own_stream(impl):
    """benchmarks/sweep.py times ``run`` on torch tensors through ``GpuTimer.capture_cupy``, on both kernel
    implementations: the graph must hold the launch (torch's current stream is the timer's inside the
    capture), or the sweep would time an empty graph and read NaN back."""
    torch = pytest.importorskip("torch")
    from metrale_attn.check.timing import GpuTimer

    p = problem(seed=7, page_size=16, seq_lens=(700, 5), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", impl=impl, splitk="4", heads_per_cta=4 if impl == "mma" else None)
    if attn.plan(2).impl != impl:  # the device failed the mma self-test (the harness records that itself)
        pytest.skip(f"impl={impl!r} built {attn.plan(2).impl!r} on this device")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    out = torch.empty_like(q)
    call = lambda: attn.run(q, k, v, bt, sl, out=out)  # noqa: E731
    timer = GpuTimer(flush_bytes=1 << 20, min_iters=2, max_iters=3, target_ms=0.1, warmup=1)
    launch = timer.capture_poisoned(call, out, warmup=1)  # what the sweep does before timing
    ref_out = p.reference()
    tolerance.assert_close_to_reference(_to_numpy_bf16(torch, out, p.q), ref_out, v_absmax=p.v_absmax())
    timing = timer.measure(launch)
    assert timing.iters >= 2 and timing.median_us > 0


# ---------------------------------------------------------------------------------------
# kernels_cu/pd_ptx.cuh on the device, against its CPU emulation (tests/support/ptx_toys.py): bit for
# bit for ldmatrix, movmatrix, cp.async, cvt and prmt; within fp32 rounding for the MMA, whose
# summation order and rounding the PTX ISA leaves open.
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def device_toys(tmp_path_factory):
    return ptx_toys.GpuRunner(tmp_path_factory.mktemp("ptx-cubins"))


def assert_within_fp32_rounding(D, A, B, C, cpu_D):
    """|D - exact| <= (k + 1) 2^-23 sum |terms| (any order, even truncating adds), for the device
    and for the CPU's fixed order; nothing closer is promised between them."""
    exact, magnitude = ptx_toys.float64_mma(A, B, C)
    bound = (A.shape[1] + 1) * 2.0**-23 * magnitude
    assert (np.abs(D - exact) <= bound).all()
    assert (np.abs(cpu_D - exact) <= bound).all()


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_device_mma_is_the_product_within_fp32_rounding_like_its_emulation(device_toys, dtype):
    for in_place in (False, True):
        A, B, C, D = ptx_toys.run_mma(device_toys, dtype, ptx_toys.rng_for("mma", dtype, in_place), in_place=in_place)
        _, _, _, cpu_D = ptx_toys.run_mma(ptx_toys.CpuRunner(), dtype, ptx_toys.rng_for("mma", dtype, in_place),
                                          in_place=in_place)
        for warp in range(D.shape[0]):
            assert_within_fp32_rounding(D[warp], A, B, C, cpu_D[warp])


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_the_device_gemm_through_cp_async_ldmatrix_and_mma_is_the_product_within_fp32_rounding(device_toys, dtype):
    A, B, D = ptx_toys.run_gemm(device_toys, dtype, ptx_toys.rng_for("gemm", dtype))
    _, _, cpu_D = ptx_toys.run_gemm(ptx_toys.CpuRunner(), dtype, ptx_toys.rng_for("gemm", dtype))
    assert_within_fp32_rounding(D, A, B, np.zeros_like(D), cpu_D)


def test_a_device_mma_of_inf_times_zero_gives_nan_where_the_emulation_does(device_toys):
    a = np.zeros((32, 4), np.uint32)
    a[0, 0] = 0x7F80  # A[0][0] = +inf (bf16)
    b, c = np.zeros((32, 2), np.uint32), np.zeros((32, 4), np.float32)
    d = ptx_toys.run_mma_regs(device_toys, a, b, c, False)
    cpu = ptx_toys.run_mma_regs(ptx_toys.CpuRunner(), a, b, c, False)
    np.testing.assert_array_equal(np.isnan(d), np.isnan(cpu))
    print("device NaN bits:", sorted({hex(x) for x in d.view(np.uint32)[np.isnan(d)]}))


@pytest.mark.parametrize("num, trans", ptx_toys.LDMATRIX_VARIANTS)
def test_device_ldmatrix_is_bit_identical_to_its_emulation(device_toys, num, trans):
    rows, row_of_lane = ptx_toys.ldmatrix_rows(ptx_toys.rng_for("ptx-ldmatrix", num, trans), num)
    device = ptx_toys.run_ldmatrix(device_toys, num, trans, rows, row_of_lane)
    np.testing.assert_array_equal(device, ptx_toys.run_ldmatrix(ptx_toys.CpuRunner(), num, trans, rows, row_of_lane))


def test_device_movmatrix_is_bit_identical_to_its_emulation(device_toys):
    frags = ptx_toys.rng_for("movmatrix").integers(0, 1 << 32, 96, dtype=np.uint64).astype(np.uint32)
    device = ptx_toys.run_movmatrix(device_toys, frags)
    np.testing.assert_array_equal(device, ptx_toys.run_movmatrix(ptx_toys.CpuRunner(), frags))


@pytest.mark.parametrize("kernel", list(ptx_toys.COPY_KERNELS))
def test_the_device_cp_async_pipeline_copies_the_bytes_the_emulation_does(device_toys, kernel):
    data, src_bytes, expect = ptx_toys.copy_case(ptx_toys.rng_for("copy", kernel), ptx_toys.COPY_KERNELS[kernel])
    np.testing.assert_array_equal(ptx_toys.run_pipelined_copy(device_toys, kernel, data, src_bytes), expect)


def test_device_wait_group_completes_at_least_the_groups_the_emulation_lands(device_toys):
    landed = ptx_toys.group_snapshots(device_toys)
    assert landed[:, ptx_toys.MUST_HAVE_LANDED].all()


@pytest.mark.parametrize("kernel", ["cvt_f16x2_e4m3x2_hi", "cvt_f16x2_e5m2x2_hi"])
def test_device_high_half_fp8_conversions_are_bit_identical_to_the_emulation(device_toys, kernel):
    inputs = ptx_toys.ALL_16_BIT.astype(np.uint32) << 16 | np.uint32(0xA5C3)
    device = ptx_toys.run_cvt(device_toys, kernel, inputs)
    np.testing.assert_array_equal(device, ptx_toys.run_cvt(ptx_toys.CpuRunner(), kernel, inputs))


@pytest.mark.parametrize("kernel", ["cvt_f16x2_e4m3x2", "cvt_f16x2_e5m2x2"])
def test_device_fp8_conversions_are_bit_identical_to_the_emulation_nan_included(device_toys, kernel):
    inputs = ptx_toys.ALL_16_BIT
    device = ptx_toys.run_cvt(device_toys, kernel, inputs)
    np.testing.assert_array_equal(device, ptx_toys.run_cvt(ptx_toys.CpuRunner(), kernel, inputs))


@pytest.mark.parametrize("kernel, half", [("cvt_bf16x2_f32", "bfloat16"), ("cvt_f16x2_f32", "float16")])
def test_device_f32_to_16_bit_rounding_is_bit_identical_to_the_emulation(device_toys, kernel, half):
    import ml_dtypes

    rng = ptx_toys.rng_for("round", kernel)
    lo = ptx_toys.rounding_inputs(rng, ml_dtypes.bfloat16 if half == "bfloat16" else np.float16)
    hi = rng.permutation(lo)
    device = ptx_toys.run_cvt(device_toys, kernel, hi, lo)
    np.testing.assert_array_equal(device, ptx_toys.run_cvt(ptx_toys.CpuRunner(), kernel, hi, lo))


def test_device_f16_to_f32_and_prmt_are_bit_identical_to_the_emulation(device_toys):
    inputs = ptx_toys.ALL_16_BIT
    device = ptx_toys.run_cvt(device_toys, "cvt_f32_f16", inputs)
    np.testing.assert_array_equal(device, ptx_toys.run_cvt(ptx_toys.CpuRunner(), "cvt_f32_f16", inputs))
    rng = ptx_toys.rng_for("prmt")
    n = 1 << 16
    sel = np.arange(n, dtype=np.uint32) | (rng.integers(0, 1 << 16, n, dtype=np.uint32) << 16)
    a, b = (rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32) for _ in range(2))
    np.testing.assert_array_equal(ptx_toys.run_cvt(device_toys, "prmt", a, b, sel), ptx_toys.prmt_model(a, b, sel))


def test_a_second_stream_while_the_first_is_busy_warns_and_capture_on_one_stream_asks_nothing():
    import warnings

    import cupy

    from metrale_attn.attention import StreamReuseWarning

    p = problem(seed=8, page_size=16, seq_lens=(600, 40), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", splitk="4")
    args = [device_array(x) for x in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)]
    out = cupy.empty(p.q.shape, dtype=p.q.dtype)
    lse = cupy.empty(p.q.shape[:2], dtype=np.float32)
    spin = cupy.RawKernel(
        'extern "C" __global__ void spin(long long cycles) {'
        ' long long t0 = clock64(); while (clock64() - t0 < cycles) {} }', "spin")
    a, b = cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    with a:
        attn.run(*args, out=out, lse=lse)
        spin((1,), (1,), (np.int64(500_000_000),))  # keeps stream a busy for ~0.25 s
    with b, pytest.warns(StreamReuseWarning, match="one stream at a time"):
        attn.run(*args, out=out, lse=lse)
    a.synchronize()
    b.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamReuseWarning)
        with a:  # b has finished: no warning
            attn.run(*args, out=out, lse=lse)
        with a:
            a.begin_capture()
            attn.run(*args, out=out, lse=lse)  # the same stream, capturing: nothing is queried
            graph = a.end_capture()
    graph.launch(a)
    a.synchronize()
    check_against_reference(p, cupy.asnumpy(out), cupy.asnumpy(lse))


# ---------------------------------------------------------------------------------------
# The torch custom op on CUDA tensors: compiled without a graph break, captured in a CUDA
# graph that replays after seq_lens and block_tables change in place; a workspace tensor
# shared by two layer shapes.
# ---------------------------------------------------------------------------------------


def test_the_custom_op_captured_in_a_cuda_graph_replays_after_seq_lens_and_block_tables_change_in_place():
    torch = pytest.importorskip("torch")
    import metrale_attn.torch_op  # noqa: F401  (registers the op)

    p = problem(seed=9, page_size=16, seq_lens=(600, 40, 1), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", splitk="auto")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    handle = attn.handle

    def step():
        torch.ops.metrale_attn.paged_decode(handle, q, k, v, bt, sl, out, lse, p.k_scale, p.v_scale)

    side = torch.cuda.Stream()  # warm up on a side stream, as torch.cuda.graph's documentation asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    # The next step's batch: sequence 0 takes sequence 1's pages and vice versa, shorter.
    rows = [1, 0, 2]
    new_bt = np.ascontiguousarray(p.block_tables[rows])
    new_sl = np.array([39, 500, 0], np.int32)
    bt.copy_(torch.from_numpy(new_bt))
    sl.copy_(torch.from_numpy(new_sl))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    changed = Problem(p.q, p.k_cache, p.v_cache, new_bt, new_sl, p.k_scale, p.v_scale, p.kv_layout)
    check_against_reference(changed, _to_numpy_bf16(torch, out, p.q), lse.cpu().numpy())


def test_a_compiled_decode_step_on_cuda_tensors_has_no_graph_break_and_gives_the_eager_bytes():
    torch = pytest.importorskip("torch")
    import metrale_attn.torch_op  # noqa: F401

    torch._dynamo.reset()
    p = problem(seed=10, page_size=16, seq_lens=(700, 5, 0), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy", splitk="4")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    handle = attn.handle

    def step(q, k, v, bt, sl):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        torch.ops.metrale_attn.paged_decode(handle, q, k, v, bt, sl, out, lse, p.k_scale, p.v_scale)
        return out, lse

    eager = step(q, k, v, bt, sl)
    compiled = torch.compile(step, fullgraph=True)(q, k, v, bt, sl)
    torch.cuda.synchronize()
    assert torch.equal(compiled[0].view(torch.int16), eager[0].view(torch.int16))
    assert torch.equal(compiled[1], eager[1])
    check_against_reference(p, _to_numpy_bf16(torch, compiled[0], p.q), compiled[1].cpu().numpy())


def test_one_cuda_workspace_tensor_serves_two_layer_shapes():
    torch = pytest.importorskip("torch")
    from metrale_attn import workspace_bytes

    shapes = [(8, 2, 128), (16, 2, 64)]
    ws = torch.empty(workspace_bytes(shapes, max_batch=3, backend="cupy", splitk="auto"), dtype=torch.uint8,
                     device="cuda")
    for seed, (h, kv, d) in enumerate(shapes):
        p = problem(seed=20 + seed, page_size=16, seq_lens=(900, 3, 0), head_dim=d, num_q_heads=h, num_kv_heads=kv)
        attn = decoder(p, backend="cupy", splitk="auto", max_batch=3, workspace=ws)
        q, k, v, bt, sl = _torch_inputs(torch, p)
        out, lse = attn.run(q, k, v, bt, sl, return_lse=True)
        torch.cuda.synchronize()
        check_against_reference(p, _to_numpy_bf16(torch, out, p.q), lse.cpu().numpy())
