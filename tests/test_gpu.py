"""The same cases on a CUDA device through CuPy; skipped cleanly where there is none."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from metrale_attn import reference
from metrale_attn.backends import cuda_available

from conftest import ARM_OPTIONS, check_against_reference, decoder, problem, run_poisoned

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA device")]


def _device(a):
    import cupy

    return cupy.asarray(a.view(np.uint8) if a.dtype.itemsize == 1 else a)


def run_gpu(attn, p, *, lse=True):
    import cupy

    n, h, d = p.q.shape
    out = cupy.asarray(np.full((n, h, d), np.nan, dtype=p.q.dtype))  # poisoned; built on the host
    lse_buf = cupy.asarray(np.full((n, h), np.nan, dtype=np.float32))
    attn.run(_device(p.q), _device(p.k_cache), _device(p.v_cache), _device(p.block_tables), _device(p.seq_lens),
             k_scale=p.k_scale, v_scale=p.v_scale, out=out, lse=lse_buf)
    return cupy.asnumpy(out), cupy.asnumpy(lse_buf)


def _cases():
    for arm in ARM_OPTIONS:
        for kv, q, d, layout in itertools.product(("bf16", "fp16", "fp8"), ("bf16", "fp16"),
                                                  (256,) if arm == "gqa_packed" else (64, 128, 256), ("NHD", "HND")):
            yield pytest.param(arm, kv, q, d, layout, id=f"{arm}-kv{kv}-q{q}-hd{d}-{layout}")


def _heads(arm):
    return dict(num_q_heads=24, num_kv_heads=4) if arm == "gqa_packed" else dict(num_q_heads=8, num_kv_heads=2)


@pytest.mark.parametrize("arm, kv, q, head_dim, layout", list(_cases()))
@pytest.mark.parametrize("page_size", [1, 16, 7])
def test_every_arm_on_the_gpu_is_within_one_ulp_and_matches_the_cpu_backend(arm, kv, q, head_dim, layout, page_size):
    lengths = (0, 1, page_size, 2 * page_size + 1, 300, 2049)
    p = problem(seed=head_dim, head_dim=head_dim, page_size=page_size, seq_lens=lengths, kv_dtype=kv, q_dtype=q,
                layout=layout, share_prefix_pages=1, **_heads(arm))
    gpu = decoder(p, backend="cupy", **ARM_OPTIONS[arm])
    assert gpu.plan(len(lengths)).arm == arm
    out, lse = run_gpu(gpu, p)
    check_against_reference(p, out, lse)
    if page_size == 16 and layout == "NHD":
        cpu_out, _ = run_poisoned(decoder(p, backend="cpu", **ARM_OPTIONS[arm]), p)
        assert reference.ulp_distance(out, cpu_out).max() <= 1


@pytest.mark.parametrize("splitk", ["auto", "4"])
def test_gpu_bytes_do_not_depend_on_the_batch(splitk):
    p = problem(seed=1, page_size=16, seq_lens=(4000, 3, 0, 1500, 257, 64, 999, 16), head_dim=128, num_q_heads=32,
                num_kv_heads=8, kv_dtype="fp8")
    attn = decoder(p, backend="cupy", splitk=splitk, max_batch=8)
    full, _ = run_gpu(attn, p)
    for target in range(8):
        rows = [target] + [r for r in range(8) if r != target][:target]
        sub = reference.Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows], p.k_scale,
                                p.v_scale, p.kv_layout)
        out, _ = run_gpu(attn, sub)
        assert out[0].tobytes() == full[target].tobytes()
    for _ in range(3):
        assert run_gpu(attn, p)[0].tobytes() == full.tobytes()


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
    q, k, v, bt, sl = (_device(a) for a in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens))
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
    changed = reference.Problem(p.q, p.k_cache, p.v_cache, p.block_tables, shorter, p.k_scale, p.v_scale,
                                p.kv_layout)
    check_against_reference(changed, cupy.asnumpy(out), cupy.asnumpy(lse))


def test_the_benchmark_timer_captures_torch_inputs_on_its_own_stream():
    """bench_decode.py times ``run`` on torch tensors through ``GpuTimer.capture_cupy``: the graph
    must hold the launch (torch's current stream is the timer's inside the capture), or the
    sweep would time an empty graph and read NaN back."""
    torch = pytest.importorskip("torch")
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
    from gpu_timing import GpuTimer

    p = problem(seed=7, page_size=16, seq_lens=(700, 5), head_dim=128, num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend="cupy")
    q, k, v, bt, sl = _torch_inputs(torch, p)
    out = torch.empty_like(q)
    call = lambda: attn.run(q, k, v, bt, sl, out=out)  # noqa: E731
    timer = GpuTimer(flush_bytes=1 << 20, min_iters=2, max_iters=3, target_ms=0.1, warmup=1)
    launch = timer.capture_poisoned(call, out, warmup=1)  # what bench_decode.py does before timing
    ref_out = p.reference()
    reference.assert_close_to_reference(_to_numpy_bf16(torch, out, p.q), ref_out, v_absmax=p.v_absmax())
    timing = timer.measure(launch)
    assert timing.iters >= 2 and timing.median_us > 0
