"""MLA's absorbed decode, values narrower than keys: ``v_head_dim=512`` at ``head_dim=576`` (512
latent + 64 rope dims; one latent KV head, DeepSeek-V3's 16 q heads a rank at TP 8), served by
the simt unpacked and split-K kernels with ``v_cache`` a strided view of ``k_cache``'s first 512
dims or its own tensor, held to the float64 reference's 1-ulp bar; the mma impl refuses it."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from metrale_attn import DecodeAttention
from metrale_attn.config import ModelShape
from metrale_attn.kernels import KernelSpec

from support.backends import SpecRecorder
from support.problems import check_against_reference, decoder, pick, problem, run_poisoned

MLA = dict(num_q_heads=16, num_kv_heads=1, head_dim=576)
FALLBACK = "ignore:.*576, 512.*has no mma kernel:RuntimeWarning"


def mla_problem(*, seed=0, v="view", page_size=16, seq_lens=(0, 1, 37), kv="bf16", q="bf16", layout="NHD", **kw):
    """A 576-wide problem whose v_cache is k_cache[..., :512] (``v="view"``) or a 512-wide tensor of its own."""
    p = problem(seed=seed, page_size=page_size, seq_lens=seq_lens, kv_dtype=kv, q_dtype=q, layout=layout,
                **{**MLA, **kw})
    v_cache = p.k_cache[..., :512] if v == "view" else np.ascontiguousarray(p.v_cache[..., 64:])
    return dataclasses.replace(p, v_cache=v_cache)


pytestmark = pytest.mark.filterwarnings(FALLBACK)


@pytest.mark.parametrize("arm, v, kv, q, page_size, layout", [
    ("unpacked", "view", "bf16", "bf16", 16, "NHD"),
    ("unpacked", "own", "fp8", "fp16", 7, "HND"),
    ("splitk", "view", "fp8", "bf16", 64, "NHD"),
    ("splitk", "own", "bf16", "bf16", 1, "NHD"),
])
def test_at_576_512_the_default_impl_runs_simt_on_both_arms_within_one_ulp_with_lse(arm, v, kv, q, page_size,
                                                                                      layout):
    p = mla_problem(seed=page_size, v=v, page_size=page_size, seq_lens=(0, 1, 2 * page_size + 1, 70), kv=kv, q=q,
                    layout=layout)
    attn = decoder(p, splitk="off" if arm == "unpacked" else "3")
    plan = attn.plan(4)
    assert (attn.impl, plan.arm, plan.impl) == ("simt", arm, "simt")
    assert plan.workspace.slot_floats == 514 if arm == "splitk" else True
    out, lse = run_poisoned(attn, p)
    assert out.shape == (4, 16, 512)
    check_against_reference(p, out, lse)


def test_at_576_512_the_rope_dims_count_in_the_scores():
    """Changing only the 64 rope dims of the cache changes the output (and still meets the bar)."""
    p = mla_problem(seed=2, seq_lens=(9, 30))
    attn = decoder(p, splitk="off")
    base, _ = run_poisoned(attn, p)
    k = p.k_cache.copy()
    k[..., 512:] = k[..., 512:][..., ::-1]
    p2 = dataclasses.replace(p, k_cache=k, v_cache=k[..., :512])
    out, lse = run_poisoned(attn, p2)
    check_against_reference(p2, out, lse)
    assert out.tobytes() != base.tobytes()


def test_at_576_512_a_sequences_bytes_do_not_depend_on_its_batch_or_position():
    p = mla_problem(seed=5, seq_lens=(70, 3, 0, 33))
    for splitk in ("auto", "off"):
        attn = decoder(p, splitk=splitk)
        full = run_poisoned(attn, p)
        check_against_reference(p, *full)
        for rows in ([3], [2, 0], [1, 3, 0]):
            out, lse = run_poisoned(attn, pick(p, rows))
            for at, r in enumerate(rows):
                assert out[at].tobytes() == full[0][r].tobytes() and lse[at].tobytes() == full[1][r].tobytes()


def test_the_view_of_k_and_a_copy_of_the_same_values_give_the_same_bytes():
    p = mla_problem(seed=7, seq_lens=(40, 5))
    own = dataclasses.replace(p, v_cache=np.ascontiguousarray(p.v_cache))
    attn = decoder(p, splitk="auto")
    assert [a.tobytes() for a in run_poisoned(attn, p)] == [a.tobytes() for a in run_poisoned(attn, own)]


@pytest.mark.parametrize("head_dim, v_head_dim", [(576, 256), (512, 576), (256, 128), (576, 576)])
def test_a_pair_other_than_equal_or_576_512_is_refused_naming_v_head_dim(head_dim, v_head_dim):
    with pytest.raises(ValueError, match="v_head_dim" if v_head_dim != head_dim else "head_dim"):
        ModelShape(16, 1, head_dim, v_head_dim)


def test_head_dim_576_without_v_head_dim_is_refused_saying_it_takes_v_head_dim_512():
    with pytest.raises(ValueError, match=r"got 576; head_dim 576 takes v_head_dim=512 \(MLA absorbed\)"):
        ModelShape(16, 1, 576)
    with pytest.raises(ValueError, match=r"got 520$"):  # no hint where no pair has that head dim
        ModelShape(16, 1, 520)


def test_576_512_takes_one_latent_kv_head():
    with pytest.raises(ValueError, match=r"num_kv_heads must be 1, got 2"):
        ModelShape(16, 2, 576, 512)


def test_a_v_cache_or_out_of_the_wrong_width_is_refused_naming_the_argument_before_any_launch():
    p = mla_problem(seed=1, seq_lens=(5,))
    attn = decoder(p)
    with pytest.raises(ValueError, match=re.escape("v_cache must be NHD [num_pages, 16, 1, 512] (its last dim is "
                                                   "v_head_dim 512)")):
        run_poisoned(attn, dataclasses.replace(p, v_cache=p.k_cache))
    with pytest.raises(ValueError, match=re.escape("out must be a contiguous [1, 16, 512] array")):
        attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, out=np.zeros((1, 16, 576), p.q.dtype))


def test_impl_mma_at_576_512_is_refused_and_the_mma_kernel_spec_too():
    p = mla_problem(seq_lens=(5,))
    with pytest.raises(ValueError, match="impl='mma' has no head_dim 576"):
        decoder(p, impl="mma")
    with pytest.raises(ValueError, match=r"\(576, 512\) has no mma unpacked kernel"):
        KernelSpec("unpacked", 576, "bf16", "bf16", "mma", v_head_dim=512)
    with pytest.raises(ValueError, match="has no simt gqa_packed kernel"):
        KernelSpec("gqa_packed", 576, "bf16", "bf16", "simt", v_head_dim=512)


def test_the_default_impl_says_why_it_runs_simt_at_576_512():
    with pytest.warns(RuntimeWarning, match=r"\(head_dim, v_head_dim\) \(576, 512\) has no mma kernel"):
        attn = DecodeAttention(16, 1, 576, 64, v_head_dim=512, q_dtype="bf16", kv_dtype="fp8", max_batch=2,
                               backend="cpu")
    assert attn.impl == "simt" and attn.config.shape.v_head_dim == 512


def test_spec_names_and_defines_carry_v_head_dim_only_where_it_differs():
    narrow = KernelSpec("splitk", 576, "bf16", "fp8", "simt", v_head_dim=512)
    assert narrow.name.endswith("_hd576_v512") and narrow.defines()["PD_V_HEAD_DIM"] == 512
    same = KernelSpec("splitk", 512, "bf16", "fp8", "simt", v_head_dim=512)
    assert same == KernelSpec("splitk", 512, "bf16", "fp8", "simt") and "PD_V_HEAD_DIM" not in same.defines()


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("v", ["view", "own"])
def test_at_576_512_every_arm_dtype_page_size_and_v_cache_holds_the_one_ulp_bar(arm, kv, q, page_size, v):
    p = mla_problem(seed=page_size, v=v, page_size=page_size, seq_lens=(0, 1, 2 * page_size + 3, 300), kv=kv, q=q)
    attn = decoder(p, splitk="off" if arm == "unpacked" else "auto")
    check_against_reference(p, *run_poisoned(attn, p))


def test_multi_token_decode_at_576_512_runs_simt_and_a_window_there_is_refused_naming_what_simt_lacks():
    """MTP's q_len up to 8 is the simt kernels' multi-token specialization
    (tests/test_simt_multi_token.py holds it to the bar); a window they still lack."""
    attn = DecodeAttention(16, 1, 576, 64, v_head_dim=512, q_dtype="bf16", kv_dtype="bf16", max_batch=2,
                           backend="cpu", max_q_len=8)
    assert attn.impl == "simt" and attn.plan(2, 8).q_len == 8
    with pytest.raises(ValueError, match=r"\(576, 512\) has no mma kernel.*impl='simt' has no window"):
        DecodeAttention(16, 1, 576, 64, v_head_dim=512, q_dtype="bf16", kv_dtype="bf16", max_batch=2, backend="cpu",
                        max_q_len=2, window_left=8)


@pytest.mark.parametrize("splitk", ["off", "3"])
def test_v_read_from_ks_registers_exactly_where_v_cache_is_k_caches_first_512_dims_with_the_same_bytes(splitk):
    p = mla_problem(seed=9, seq_lens=(0, 45, 7), kv="bf16")
    be = SpecRecorder()
    attn = decoder(p, backend=be, splitk=splitk)
    shifted = np.empty(p.k_cache.shape[:-1] + (576 + 512,), p.k_cache.dtype)  # V at an offset of another row
    shifted[..., :576], shifted[..., 576:] = p.k_cache, p.v_cache
    cases = {
        "view": (p, True),
        "own": (dataclasses.replace(p, v_cache=np.ascontiguousarray(p.v_cache)), False),
        "offset": (dataclasses.replace(p, v_cache=shifted[..., 576:]), False),  # other pointer, other strides
    }
    got = {}
    for name, (case, aliased) in cases.items():
        be.specs.clear()
        got[name] = run_poisoned(attn, case)
        check_against_reference(case, *got[name])
        assert all(s.endswith("_vink") == aliased for s in be.specs if "merge" not in s), (name, be.specs)
        assert any(s.endswith("_vink") for s in be.specs) == aliased, name
    assert len({tuple(a.tobytes() for a in g) for g in got.values()}) == 1


def test_the_aliased_and_separate_kernels_both_compile_at_construction_and_run_never_compiles():
    be = SpecRecorder()
    loaded = []
    original = be.load
    be.load = lambda spec: (loaded.append(spec.name), original(spec))[1]
    p = mla_problem(seed=4, seq_lens=(3,))
    attn = decoder(p, backend=be, splitk="off")
    built = list(loaded)
    assert sorted(built) == ["simt_decode_unpacked_qbf16_kvbf16_hd576_v512",
                             "simt_decode_unpacked_qbf16_kvbf16_hd576_v512_vink"]
    run_poisoned(attn, p)
    run_poisoned(attn, dataclasses.replace(p, v_cache=np.ascontiguousarray(p.v_cache)))
    assert loaded == built


def test_fp16_and_fp8_caches_read_v_on_its_own_even_when_it_aliases_k():
    """Their V-in-K kernels would spill on sm_90 and later: no such spec, the view reads V again."""
    with pytest.raises(ValueError, match="v_in_k"):
        KernelSpec("unpacked", 576, "bf16", "fp8", "simt", v_head_dim=512, v_in_k=True)
    p = mla_problem(seed=3, seq_lens=(20,), kv="fp8")
    be = SpecRecorder()
    check_against_reference(p, *run_poisoned(decoder(p, backend=be, splitk="off"), p))
    assert be.specs == ["simt_decode_unpacked_qbf16_kvfp8_hd576_v512"]


def test_a_shared_workspace_is_sized_by_v_head_dim():
    from metrale_attn import workspace_bytes

    mla = workspace_bytes([(16, 1, 576, 512)], max_batch=4, backend="cpu", splitk="auto")
    wide = workspace_bytes([(16, 1, 512)], max_batch=4, backend="cpu", splitk="auto")
    assert mla == wide  # slots of 514 floats either way: the values' width, not the keys'
    attn = DecodeAttention(16, 1, 576, 16, v_head_dim=512, q_dtype="bf16", kv_dtype="bf16", max_batch=4,
                           backend="cpu", splitk="auto")
    assert attn.workspace_nbytes <= mla
