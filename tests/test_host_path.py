"""run()'s host path: a call with the previous call's buffers reuses its validated launches, and
every check still holds for every buffer that is new, or that changed in place."""

from __future__ import annotations

import numpy as np
import pytest

from support.problems import check_against_reference, decoder, problem

P = problem(seq_lens=(5, 40), head_dim=64, page_size=16)


def _args(p=P):
    return p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens


def _outputs():
    return np.full(P.q.shape, np.nan, P.q.dtype), np.full(P.q.shape[:2], np.nan, np.float32)


def test_repeated_calls_with_the_same_buffers_reuse_the_validated_launches_and_stay_correct(counting_backend):
    attn = decoder(P, backend=counting_backend, splitk="3")
    out, lse = _outputs()
    attn.run(*_args(), out=out, lse=lse)
    first = attn._binder.last
    out[:] = np.nan
    attn.run(*_args(), out=out, lse=lse)
    assert attn._binder.last is first  # nothing was validated again
    assert counting_backend.launches == ["decode_splitk", "decode_splitk_merge"] * 2
    check_against_reference(P, out, lse)


def test_new_buffers_of_the_same_layout_get_new_pointers_and_every_check():
    attn = decoder(P)
    out1, lse = _outputs()
    attn.run(*_args(), out=out1, lse=lse)
    out2, _ = _outputs()
    attn.run(*_args(), out=out2, lse=lse)
    check_against_reference(P, out2, lse)
    with pytest.raises(ValueError, match="out overlaps q"):
        attn.run(*_args(), out=P.q, lse=lse)
    with pytest.raises(ValueError, match="lse overlaps out"):
        attn.run(*_args(), out=out2, lse=out2.reshape(-1)[:16].view(np.float32).reshape(2, 4))


def test_an_array_changed_in_place_since_the_last_call_is_checked_again():
    attn = decoder(P)
    out, lse = _outputs()
    attn.run(*_args(), out=out, lse=lse)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writable"):
        attn.run(*_args(), out=out, lse=lse)
    out.flags.writeable = True
    lse.shape = (4, 2)  # the same object, reshaped in place
    with pytest.raises(ValueError, match="lse must be a contiguous float32"):
        attn.run(*_args(), out=out, lse=lse)
    lse.shape = (2, 4)
    attn.run(*_args(), out=out, lse=lse)
    check_against_reference(P, out, lse)


def test_index_contents_are_checked_on_every_call_even_with_the_same_buffers():
    attn = decoder(P)
    lens = P.seq_lens.copy()
    out, lse = _outputs()
    attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, lens, out=out, lse=lse)
    lens[1] = 10**5
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 100000"):
        attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, lens, out=out, lse=lse)


@pytest.mark.parametrize("k_scale, error, match", [(float("nan"), ValueError, "k_scale must be a finite float > 0"),
                                                   (True, TypeError, "k_scale must be a Python or NumPy float"),
                                                   (1e39, ValueError, r"k_scale = 1e\+39")])
def test_scales_are_checked_again_whenever_they_are_not_the_same_floats(k_scale, error, match):
    attn = decoder(P)
    out, lse = _outputs()
    attn.run(*_args(), k_scale=1.0, out=out, lse=lse)
    with pytest.raises(error, match=match):
        attn.run(*_args(), k_scale=k_scale, out=out, lse=lse)


def test_a_changed_scale_reaches_the_kernel():
    attn = decoder(P)
    out, lse = _outputs()
    attn.run(*_args(), out=out, lse=lse)
    attn.run(*_args(), k_scale=0.5, v_scale=2.0, out=out, lse=lse)
    ref = P.reference()
    scaled = type(P)(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, 0.5, 2.0, P.kv_layout)
    check_against_reference(scaled, out, lse)
    assert not np.array_equal(out, ref.astype(out.dtype))


def test_a_torch_tensor_whose_storage_was_swapped_in_place_is_checked_again():
    from support.optional import import_torch

    torch = import_torch()
    from metrale_attn.torch_op import from_numpy, to_numpy

    attn = decoder(P)
    out = torch.full(P.q.shape, float("nan"), dtype=torch.bfloat16)
    attn.run(*_args(), out=out)
    out.set_(torch.empty((2, 4, 32), dtype=torch.bfloat16))  # same object, other memory and shape
    with pytest.raises(ValueError, match=r"out must be a contiguous \[2, 4, 64\]"):
        attn.run(*_args(), out=out)
    out.set_(torch.full(P.q.shape, float("nan"), dtype=torch.bfloat16))
    lse = from_numpy(np.full(P.q.shape[:2], np.nan, np.float32))
    attn.run(*_args(), out=out, lse=lse)
    check_against_reference(P, to_numpy(out), to_numpy(lse))


def test_a_new_buffer_of_the_same_layout_at_a_misaligned_address_is_refused():
    """Same shape, strides and dtype as the last call's q, two bytes further on: the checks
    that read the address (16-byte alignment) run again."""
    attn = decoder(P)
    out, lse = _outputs()
    buf = np.zeros(P.q.size + 64, P.q.dtype)
    aligned = next(i for i in range(64) if buf[i:].__array_interface__["data"][0] % 16 == 0)
    q1 = buf[aligned:aligned + P.q.size].reshape(P.q.shape)
    q1[:] = P.q
    attn.run(q1, *_args()[1:], out=out, lse=lse)
    check_against_reference(P, out, lse)
    q2 = buf[aligned + 8:aligned + 8 + P.q.size].reshape(P.q.shape)  # 16 bytes on: fine
    q2[:] = P.q
    attn.run(q2, *_args()[1:], out=out, lse=lse)
    check_against_reference(P, out, lse)
    q3 = buf[aligned + 1:aligned + 1 + P.q.size].reshape(P.q.shape)  # 2 bytes on
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        attn.run(q3, *_args()[1:], out=out, lse=lse)
