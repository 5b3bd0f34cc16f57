"""Reliability, round 2: what an adversarial review found the new features let through. Each
test pins one defect: memory the kernels would corrupt or read wrongly, a launch a GPU would
refuse, or a refusal that named nothing. Every refusal comes before any launch and names the
argument and what was expected."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from metrale_attn import DecodeAttention, merge_states, tolerance
from metrale_attn.backends import cpu_backend
import metrale_attn.backends as backends

from support.optional import import_torch
from support.problems import check_against_reference, decoder, problem, run_poisoned

P = problem(seed=21, seq_lens=(0, 1, 37, 300), num_q_heads=8, num_kv_heads=2)


def _misaligned(like: np.ndarray) -> np.ndarray:
    """A copy of ``like`` one byte past an aligned address (NumPy allows unaligned arrays)."""
    raw = np.zeros(like.nbytes + 8, np.uint8)
    view = raw[1:1 + like.nbytes].view(like.dtype).reshape(like.shape)
    view[...] = like
    return view


def _inside(buffer: np.ndarray, like: np.ndarray, offset: int = 0) -> np.ndarray:
    """A copy of ``like`` placed in ``buffer``'s bytes at ``offset`` (a view of ``buffer``)."""
    view = buffer[offset:offset + like.nbytes].view(like.dtype).reshape(like.shape)
    view[...] = like
    return view


# -- memory the kernels would corrupt or misread ----------------------------------------------


@pytest.mark.parametrize("argument", ["q", "k_cache", "block_tables", "seq_lens", "sinks"])
def test_an_input_inside_the_callers_workspace_is_refused_naming_it(argument):
    """D2: the kernels write their partials there mid-call (wrong bytes, or a segfault when the
    block table or lengths are overwritten)."""
    attn = decoder(P, splitk="4", sinks=True)
    sinks = np.zeros(8, np.float32)
    arrays = dict(q=P.q, k_cache=P.k_cache, block_tables=P.block_tables, seq_lens=P.seq_lens, sinks=sinks)
    workspace = np.zeros(attn.workspace_nbytes + arrays[argument].nbytes + 64, np.uint8)
    shared = decoder(P, splitk="4", sinks=True, workspace=workspace)
    arrays[argument] = _inside(workspace, arrays[argument], 64)
    out = np.empty_like(P.q)
    with pytest.raises(ValueError, match=f"{argument} lies in the split-K workspace"):
        shared.run(arrays["q"], arrays["k_cache"], P.v_cache, arrays["block_tables"], arrays["seq_lens"],
                   sinks=arrays["sinks"], out=out)


def test_an_input_inside_another_objects_part_of_a_shared_workspace_is_refused():
    """The objects of one workspace write the same bytes: an input in the part only a larger
    object uses is overwritten when that object runs, so it is refused for every one of them."""
    small = decoder(P, splitk="4")
    workspace = np.zeros(small.workspace_nbytes * 4, np.uint8)
    big = decoder(P, splitk="4", max_batch=16, workspace=workspace)
    mine = decoder(P, splitk="4", workspace=workspace[:small.workspace_nbytes])
    assert big.workspace_nbytes > small.workspace_nbytes
    q = _inside(workspace, P.q, small.workspace_nbytes + 64)
    with pytest.raises(ValueError, match="q lies in the split-K workspace"):
        mine.run(q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, out=np.empty_like(P.q))


def test_a_call_validated_before_another_object_joined_the_workspace_is_checked_again():
    first = decoder(P, splitk="4")
    workspace = np.zeros(first.workspace_nbytes * 2 + P.q.nbytes + 64, np.uint8)
    mine = decoder(P, splitk="4", workspace=workspace[:first.workspace_nbytes])
    q = _inside(workspace, P.q, workspace.size - P.q.nbytes)
    out = np.empty_like(P.q)
    mine.run(q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, out=out)  # outside its workspace: fine
    decoder(P, splitk="4", workspace=workspace)  # now the workspace covers q
    with pytest.raises(ValueError, match="q lies in the split-K workspace"):
        mine.run(q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, out=out)


@pytest.mark.parametrize("how", ["storage resized to 0", "storage replaced (set_)"])
def test_a_torch_workspace_whose_memory_went_away_is_refused_on_the_next_call_even_the_cached_one(how):
    """D13: the kernels would write into freed memory (heap corruption)."""
    torch = import_torch()
    from metrale_attn.torch_op import from_numpy

    probe = decoder(P, splitk="4")
    workspace = torch.zeros(probe.workspace_nbytes, dtype=torch.uint8)
    attn = decoder(P, splitk="4", workspace=workspace)
    args = [from_numpy(a) for a in (P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens)]
    out = torch.empty(P.q.shape, dtype=torch.bfloat16)
    attn.run(*args, out=out)  # validated; the next call with these buffers is the cached path
    if how == "storage resized to 0":
        workspace.untyped_storage().resize_(0)
    else:
        workspace.set_(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="the workspace tensor no longer holds its memory"):
        attn.run(*args, out=out)


def test_a_window_as_wide_as_int32_with_a_multi_token_call_still_has_every_page_id_it_reads_checked():
    """D3: the host index check computed ``lens - q_len - window`` in int32: with a window of
    2^31 - 1 and 3 query tokens on a sequence of length 1 it wrapped, the check skipped every
    page, and the kernel read page 0x3FFFFFFF."""
    p = problem(seed=22, seq_lens=(1, 3, 40), num_q_heads=4, num_kv_heads=2)
    attn = decoder(p, max_q_len=3, window_left=2**31 - 1)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((3, 3, 4, 64)).astype(ml_dtypes.bfloat16)
    out = np.full(q.shape, np.nan, q.dtype)
    attn.run(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, out=out)
    tolerance.assert_close_to_reference(out, p.reference(q=q, window_left=2**31 - 1), v_absmax=p.v_absmax())
    wild = p.block_tables.copy()
    wild[0, 0] = 0x3FFFFFFF  # the one page sequence 0 reads
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\] = 1073741823 is not a page id"):
        attn.run(q, p.k_cache, p.v_cache, wild, p.seq_lens, out=out)


@pytest.mark.parametrize("options, grid", [
    (dict(max_batch=8192, max_q_len=8, splitk="2"), r"decode_splitk_merge grid \(4, 65536, 1\)"),
    (dict(max_batch=70000, splitk="off"), r"decode_unpacked grid \(2, 70000, 1\)"),
])
def test_a_plan_whose_grid_a_gpu_would_refuse_is_refused_at_construction(options, grid):
    """D6: gridDim.y may not pass 65535."""
    with pytest.raises(ValueError, match=grid + r" is past CUDA's limits \(y = \d+ > 65535\)"):
        DecodeAttention(4, 2, 64, 16, q_dtype="bfloat16", kv_dtype="bfloat16", backend="cpu", **options)


@pytest.mark.parametrize("argument", ["lse", "seq_lens", "sinks", "block_tables"])
def test_a_misaligned_four_byte_array_is_refused_before_anything_is_launched(argument, monkeypatch):
    """D14: int32 and float32 arrays are read and written 4 bytes at a time."""
    attn = decoder(P, splitk="4", sinks=True)
    launched = []
    monkeypatch.setattr(cpu_backend._CpuModule, "launch", lambda self, launch: launched.append(launch))
    n, h = P.q.shape[:2]
    arrays = dict(lse=np.zeros((n, h), np.float32), seq_lens=P.seq_lens, sinks=np.zeros(h, np.float32),
                  block_tables=P.block_tables)
    arrays[argument] = _misaligned(arrays[argument])
    with pytest.raises(ValueError, match=f"{argument} must start on a 4-byte boundary"):
        attn.run(P.q, P.k_cache, P.v_cache, arrays["block_tables"], arrays["seq_lens"], sinks=arrays["sinks"],
                 out=np.empty_like(P.q), lse=arrays["lse"])
    assert launched == []


def test_the_torch_op_with_a_meta_query_beside_cpu_tensors_is_refused_not_silently_skipped():
    """D15: a meta tensor dispatched the op to its fake implementation, which returned with
    ``out`` unwritten."""
    torch = import_torch()
    import metrale_attn.torch_op  # noqa: F401  (registers the op)

    attn = decoder(P)
    q = torch.zeros(P.q.shape, dtype=torch.bfloat16, device="meta")
    k = torch.zeros(P.k_cache.shape, dtype=torch.bfloat16)
    bt, sl = torch.from_numpy(P.block_tables), torch.from_numpy(P.seq_lens)
    out = torch.empty(P.q.shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="every tensor must be on one device, got cpu, meta"):
        torch.ops.metrale_attn.paged_decode(attn.handle, q, k, k, bt, sl, out, None, 1.0, 1.0)


@pytest.mark.parametrize("sink", [3.0e38, -3.0e38, 2.4e38])
def test_a_finite_sink_past_what_the_kernels_hold_in_base_2_is_refused_on_the_host(sink):
    """D1: sink x log2(e) overflowed to inf in the kernels (all-NaN out and lse)."""
    attn = decoder(P, sinks=True)
    sinks = np.zeros(8, np.float32)
    sinks[5] = sink
    with pytest.raises(ValueError, match=r"sinks\[5\] = .*: sink logits must be -inf or finite with \|sink\| <= "):
        attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, sinks=sinks)


# -- where a GPU machine would have surprised -------------------------------------------------


def test_no_backend_on_a_machine_with_a_gpu_but_no_cupy_is_an_error_naming_the_install_line(monkeypatch):
    monkeypatch.setattr(backends, "cuda_available", lambda: False)
    monkeypatch.setattr(backends, "gpu_present", lambda paths=None: "/dev/nvidia0")
    with pytest.raises(RuntimeError, match=r"has an NVIDIA GPU \(/dev/nvidia0\) but CuPy .*metrale-attn\[cuda12\]"):
        DecodeAttention(4, 2, 64, 16, q_dtype="bfloat16", kv_dtype="bfloat16", max_batch=2)
    assert backends.get_backend("cpu").name == "cpu"  # on purpose, still possible


# -- refusals that were unclear, or wrong --------------------------------------------------------


def test_sinks_given_as_a_torch_parameter_that_requires_grad_are_read_without_an_error():
    """D16: the host sink check called ``numpy()`` on a tensor that requires grad."""
    torch = import_torch()
    from metrale_attn.torch_op import from_numpy

    attn = decoder(P, sinks=True)
    sinks = torch.nn.Parameter(torch.tensor([0.5, -1, 2, float("-inf"), 0, 1, -2, 3], dtype=torch.float32))
    out = torch.empty(P.q.shape, dtype=torch.bfloat16)
    args = [from_numpy(a) for a in (P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens)]
    attn.run(*args, out=out, sinks=sinks)
    from metrale_attn.torch_op import to_numpy

    ref = P.reference(sinks=sinks.detach().numpy())
    tolerance.assert_close_to_reference(to_numpy(out), ref, v_absmax=P.v_absmax())


def test_empty_arrays_with_numpy_2s_zero_strides_are_accepted_by_run_and_merge_states():
    """D9: ``np.empty((0, ...))`` has strides of 0 under NumPy 2; nothing is read through them."""
    attn = decoder(P)
    q = np.empty((0, 8, 64), ml_dtypes.bfloat16)
    out = attn.run(q, P.k_cache, P.v_cache, np.empty((0, 4), np.int32), np.empty((0,), np.int32),
                   out=np.empty((0, 8, 64), ml_dtypes.bfloat16))
    assert out.shape == (0, 8, 64)
    v, s = np.empty((0, 8, 64), np.float32), np.empty((0, 8), np.float32)
    merged, lse = merge_states(v, s, v.copy(), s.copy())
    assert merged.shape == (0, 8, 64) and lse.shape == (0, 8)


def test_heads_per_cta_may_be_any_integral_type():
    """D10: ``np.int64(2)`` was a TypeError although integers may be any numbers.Integral."""
    attn = decoder(P, heads_per_cta=np.int64(2))
    assert attn.heads_per_cta == 2 and type(attn.heads_per_cta) is int
    with pytest.raises(TypeError, match="heads_per_cta must be an int"):
        decoder(P, heads_per_cta=True)


@pytest.mark.parametrize("spelling", ["\x1c2", "\u0662", "\u00b2", "2.0", "-2"])
def test_the_heads_per_cta_variable_is_read_as_the_split_k_variable_is(spelling, monkeypatch):
    """D11: one parser for every environment variable: ASCII digits, Unicode whitespace
    trimmed; ``"\\x1c2"`` and an Arabic-Indic two were accepted as 2, ``"²"`` failed inside
    ``int()`` without naming the variable."""
    monkeypatch.setenv("METRALE_ATTN_DECODE_HEADS_PER_CTA", spelling)
    with pytest.raises(ValueError, match="METRALE_ATTN_DECODE_HEADS_PER_CTA must be a positive decimal integer"):
        decoder(P)
    monkeypatch.setenv("METRALE_ATTN_DECODE_HEADS_PER_CTA", "\u3000 2\t")
    assert decoder(P).heads_per_cta == 2


def test_the_plan_command_shows_what_the_library_would_run_under_the_same_environment():
    """D12: ``metrale-attn plan`` ignored ``METRALE_ATTN_DECODE_IMPL`` and
    ``METRALE_ATTN_DECODE_HEADS_PER_CTA``."""
    env = dict(os.environ, METRALE_ATTN_DECODE_IMPL="simt")
    done = subprocess.run([sys.executable, "-m", "metrale_attn", "plan", "--model", "llama-3-8b", "--batch", "1"],
                          capture_output=True, text=True, env=env, check=True)
    assert "impl simt" in done.stdout and "  splitk           9      1  " in done.stdout
    env.update(METRALE_ATTN_DECODE_IMPL="mma", METRALE_ATTN_DECODE_HEADS_PER_CTA="2")
    done = subprocess.run([sys.executable, "-m", "metrale_attn", "plan", "--model", "llama-3-8b", "--batch", "1"],
                          capture_output=True, text=True, env=env, check=True)
    assert "impl mma" in done.stdout and "  splitk           9      2  " in done.stdout


def test_merge_states_refuses_read_only_outputs_and_takes_torch_cpu_tensors_without_a_backend():
    torch = import_torch()
    v, s = np.zeros((2, 4, 64), np.float32), np.zeros((2, 4), np.float32)
    read_only = np.zeros((2, 4, 64), np.float32)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        merge_states(v, s, v.copy(), s.copy(), out=read_only)
    merged, lse = merge_states(torch.zeros(2, 4, 64), torch.zeros(2, 4), torch.zeros(2, 4, 64), torch.zeros(2, 4))
    assert isinstance(merged, torch.Tensor) and torch.allclose(lse, torch.full((2, 4), np.log(2.0)))


def test_a_bool_is_not_a_handle():
    """``True == 1``: the op called object 1 with a handle of True."""
    decoder(P)
    with pytest.raises(TypeError, match="a handle is the int attn.handle, got True"):
        DecodeAttention.from_handle(True)


def test_a_logits_soft_cap_of_zero_means_no_cap_as_in_flashinfer_vllm_and_flashattention():
    capped, plain = decoder(P, logits_soft_cap=0.0), decoder(P)
    assert capped.logits_soft_cap is None
    out0, lse0 = run_poisoned(capped, P)
    out1, lse1 = run_poisoned(plain, P)
    assert out0.tobytes() == out1.tobytes() and lse0.tobytes() == lse1.tobytes()
    check_against_reference(P, out0, lse0)


def test_a_target_whose_shared_memory_no_mma_tiling_fits_runs_simt_with_a_warning_or_refuses(monkeypatch):
    """Every target declared today holds a tiling of every head dim (2 warps of 2 stages fit 99
    KiB at 256); a target of 48 KiB per block (gb10 declared smaller here) does not at head dim
    256, so an object falls back to simt, saying so, and one that also asked for mma, or for a
    feature only mma has, is refused."""
    from dataclasses import replace

    from metrale_attn.targets import TARGETS

    p = problem(seed=23, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2, head_dim=256)
    assert decoder(p, target="gb10").impl == "mma"
    monkeypatch.setitem(TARGETS, "gb10", replace(TARGETS["gb10"], smem_per_block=48 * 1024))
    with pytest.warns(RuntimeWarning, match=r"mma kernels of this shape ask for \d+ bytes of shared memory "
                                            r"per block; gb10 \(sm_121\) allows 49152; using impl='simt'"):
        attn = decoder(p, target="gb10")
    assert attn.impl == "simt"
    check_against_reference(p, *run_poisoned(attn, p))
    for options in (dict(impl="mma"), dict(window_left=8), dict(sinks=True)):
        with pytest.raises(ValueError, match="allows 49152: they cannot launch there"):
            decoder(p, target="gb10", **options)


def test_an_fp8_cache_on_a_target_without_the_fp8_conversion_runs_simt_or_is_refused():
    """The mma core reads fp8 with PTX's fp8 cvt (sm_89 on): on a100 (sm_80) and a10 (sm_86) an
    fp8 e4m3 cache runs the simt kernels, which convert in software, saying so; an e5m2 cache
    (simt has none), a feature, or impl="mma" asked for is refused; a bf16 cache keeps mma."""
    p = problem(seed=29, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2, kv_dtype="fp8")
    for target, arch in (("a100", "sm_80"), ("a10", "sm_86")):
        with pytest.warns(RuntimeWarning, match=rf"fp8 cvt, which {target} \({arch}\) lacks.*using impl='simt'"):
            attn = decoder(p, target=target)
        assert attn.impl == "simt"
        check_against_reference(p, *run_poisoned(attn, p))
        for options in (dict(impl="mma"), dict(window_left=8)):
            with pytest.raises(ValueError, match=rf"{target} \({arch}\) lacks .*they cannot launch there"):
                decoder(p, target=target, **options)
    e5m2 = problem(seed=29, seq_lens=(5,), num_q_heads=4, num_kv_heads=2, kv_dtype="fp8_e5m2")
    with pytest.raises(ValueError, match="lacks"):
        decoder(e5m2, target="a100")
    assert decoder(problem(seed=29, seq_lens=(5,), num_q_heads=4, num_kv_heads=2), target="a100").impl == "mma"


def test_the_self_test_does_not_ask_a_device_without_the_fp8_conversion_for_it():
    """Before sm_89 the self-test kernel leaves the fp8 cvt words out (the mma kernels read no
    fp8 cache there), and their comparison is skipped; everything else is still compared."""
    from metrale_attn.backends import selftest

    want_w, want_f = selftest.expected(selftest.inputs())
    words = want_w.copy()
    cvt = [j for j, (name, _) in enumerate(selftest.FIELDS) if name.startswith("cvt.rn.f16x2.e4m3x2")]
    words[:, cvt] = 0
    assert selftest.disagreements(words, want_f, fp8=False) == []
    assert selftest.disagreements(words, want_f) == ["cvt.rn.f16x2.e4m3x2", "cvt.rn.f16x2.e4m3x2 of a high half"]
    words[:, 0] ^= 1
    assert selftest.disagreements(words, want_f, fp8=False) == ["ldmatrix.x4"]


def test_the_self_test_names_the_high_half_fp8_conversion_when_only_it_disagrees():
    """The kernels' fp8_hi reads a word's high half by an operand selector: a device that got
    that form wrong, and the 16-bit form right, is caught and named."""
    from metrale_attn.backends import selftest

    want_w, want_f = selftest.expected(selftest.inputs())
    words = want_w.copy()
    high = [j for j, (name, _) in enumerate(selftest.FIELDS) if name.endswith("of a high half")]
    assert len(high) == 2
    words[:, high[1]] ^= 0x00010000
    assert selftest.disagreements(words, want_f) == ["cvt.rn.f16x2.e4m3x2 of a high half"]
