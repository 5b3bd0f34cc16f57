"""PyTorch on the CPU backend: torch CPU tensors in and out without copies (bf16, fp16, fp8
and its uint8 bits, strided views, ``out=``/``lse=`` given). CI installs torch and sets
``METRALE_ATTN_REQUIRE_TORCH``, so none of this is skipped there."""

from __future__ import annotations

import numpy as np
import pytest

from support.optional import import_torch
from support.problems import check_against_reference, decoder, problem

torch = import_torch()
from metrale_attn.torch_op import from_numpy, to_numpy  # noqa: E402  (after torch: this imports it)


def _tensors(p, kv_bits=False):
    """q, k, v, block_tables, seq_lens of ``p`` as torch CPU tensors sharing its memory."""
    k, v = (from_numpy(a.view(np.uint8) if kv_bits else a) for a in (p.k_cache, p.v_cache))
    return from_numpy(p.q), k, v, from_numpy(p.block_tables), from_numpy(p.seq_lens)


def _nan_out(p):
    out = torch.full(p.q.shape, float("nan"), dtype=from_numpy(p.q[:0]).dtype)
    return out, torch.full(p.q.shape[:2], float("nan"), dtype=torch.float32)


@pytest.mark.parametrize("kv, q, bits", [("bf16", "bf16", False), ("fp16", "fp16", False), ("fp8", "bf16", False),
                                         ("fp8", "fp16", True)],
                         ids=["kvbf16-qbf16", "kvfp16-qfp16", "kvfp8-qbf16", "kvuint8-qfp16"])
def test_torch_cpu_tensors_go_in_and_the_given_out_and_lse_come_back_written_in_place(kv, q, bits):
    p = problem(seed=3, kv_dtype=kv, q_dtype=q)
    q_t, k_t, v_t, bt_t, sl_t = _tensors(p, kv_bits=bits)
    assert k_t.dtype == (torch.uint8 if bits else {"bf16": torch.bfloat16, "fp16": torch.float16,
                                                    "fp8": torch.float8_e4m3fn}[kv])
    out, lse = _nan_out(p)
    where = out.data_ptr(), lse.data_ptr()
    got = decoder(p).run(q_t, k_t, v_t, bt_t, sl_t, k_scale=p.k_scale, v_scale=p.v_scale, out=out, lse=lse)
    assert got[0] is out and got[1] is lse and (out.data_ptr(), lse.data_ptr()) == where
    check_against_reference(p, to_numpy(out), to_numpy(lse))


def test_without_out_the_outputs_are_new_torch_tensors_of_qs_dtype():
    p = problem(seed=4, kv_dtype="fp8", q_dtype="fp16")
    out, lse = decoder(p).run(*_tensors(p), k_scale=p.k_scale, v_scale=p.v_scale, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.shape == p.q.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32 and lse.shape == p.q.shape[:2]
    check_against_reference(p, to_numpy(out), to_numpy(lse))


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_torch_views_k_and_v_halves_of_one_kv_tensor_and_q_inside_a_wider_buffer(layout):
    p = problem(seed=5, layout=layout, seq_lens=(3, 40, 17))
    kv = torch.stack([from_numpy(p.k_cache), from_numpy(p.v_cache)], dim=1)  # [pages, 2, ...]: vLLM's layout
    wide = torch.zeros((p.q.shape[0], p.q.shape[1], p.q.shape[2] + 64), dtype=torch.bfloat16)
    wide[:, :, 32:32 + p.q.shape[2]] = from_numpy(p.q)
    q = wide[:, :, 32:32 + p.q.shape[2]]
    assert not q.is_contiguous() and not kv[:, 0].is_contiguous()
    out, lse = _nan_out(p)
    decoder(p).run(q, kv[:, 0], kv[:, 1], from_numpy(p.block_tables), from_numpy(p.seq_lens), k_scale=p.k_scale,
                   v_scale=p.v_scale, out=out, lse=lse)
    check_against_reference(p, to_numpy(out), to_numpy(lse))


def test_numpy_and_torch_arguments_may_be_mixed_in_one_call():
    p = problem(seed=6)
    out, lse = _nan_out(p)
    decoder(p).run(from_numpy(p.q), p.k_cache, p.v_cache, from_numpy(p.block_tables), p.seq_lens, out=out, lse=lse)
    check_against_reference(p, to_numpy(out), to_numpy(lse))


def test_a_tensor_on_another_device_is_refused_naming_it():
    p = problem(seed=7)
    with pytest.raises(ValueError, match="k_cache must be a CPU tensor on the cpu backend, got a tensor on meta"):
        decoder(p).run(p.q, torch.empty(p.k_cache.shape, dtype=torch.bfloat16, device="meta"), p.v_cache,
                       p.block_tables, p.seq_lens)


def test_index_checks_read_torch_index_tensors_in_place():
    p = problem(seed=8, seq_lens=(5, 40))
    bt = from_numpy(p.block_tables.copy())
    bt[1, 2] = 10**6
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = 1000000"):
        decoder(p).run(*_tensors(p)[:3], bt, from_numpy(p.seq_lens))


def test_from_numpy_and_to_numpy_share_memory_for_every_dtype_the_kernels_take():
    p = problem(seed=9, kv_dtype="fp8")
    for a in (p.q, p.k_cache, p.block_tables, p.seq_lens, p.k_cache.view(np.uint8)):
        t = from_numpy(a)
        assert t.data_ptr() == a.__array_interface__["data"][0] and to_numpy(t).dtype == a.dtype
        assert to_numpy(t).tobytes() == a.tobytes()
