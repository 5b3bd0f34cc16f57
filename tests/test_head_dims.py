"""Head dims: the mma core serves every multiple of 16 from 64 to 256 (models use 64, 80, 96,
112, 128, 160, 192, 256), computing at the dim rounded up to 32 (mma_layout.cuh's DP) and
reading and writing only the real ones, so each meets the same 1-ulp bar as 64, 128 and 256;
the simt kernels keep 64, 128 and 256 and add 512 (Gemma 4's global layers), which the default
impl runs on them, and anything else is refused naming head_dim."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from metrale_attn import hf_config, reference
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import ENV_IMPL, HEAD_DIMS, SIMT_HEAD_DIMS, ModelShape, max_rows_per_cta
from metrale_attn.kernels import KernelSpec, mma_tiling
from metrale_attn.tiling import mma_padded_dim
from metrale_attn.precompile import Layer, Options, layers_of, needed_specs
from metrale_attn.targets import TARGETS

from support.problems import check_against_reference, decoder, pick, problem, run_poisoned

PADDED = tuple(d for d in HEAD_DIMS if d % 32)
"""The head dims whose rows the core pads by 16 dims: 80, 112, ..., 240."""


def test_the_mma_head_dims_are_every_multiple_of_16_from_64_to_256_and_simt_keeps_64_128_256_and_adds_512():
    assert HEAD_DIMS == (64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)
    assert SIMT_HEAD_DIMS == (64, 128, 256, 512)
    assert [mma_padded_dim(d) for d in (64, 80, 96, 112, 128, 240, 256)] == [64, 96, 96, 128, 128, 256, 256]


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_every_multiple_of_16_from_64_to_256_holds_the_one_ulp_bar(backend, head_dim, kv):
    """Unpacked, small: a few tokens across ragged pages, both layouts and q dtypes in turn."""
    p = problem(seed=head_dim, head_dim=head_dim, page_size=7, seq_lens=(0, 1, 9, 40), kv_dtype=kv,
                q_dtype=("bf16", "fp16")[head_dim // 16 % 2], layout=("NHD", "HND")[head_dim // 32 % 2])
    attn = decoder(p, backend=backend, splitk="off")
    assert (attn.plan(4).arm, attn.plan(4).impl) == ("unpacked", "mma")
    check_against_reference(p, *run_poisoned(attn, p))


@pytest.mark.parametrize("head_dim, kv, q", [(80, "fp16", "fp16"), (144, "bf16", "fp16"), (240, "fp8_e5m2", "bf16")])
def test_split_k_at_padded_head_dims_holds_the_bar_and_keeps_the_workspace_layout_of_head_dim_plus_2(backend, head_dim, kv, q):
    """The workspace slot stays head_dim + 2 fp32 of the real dim: the padding never reaches it."""
    p = problem(seed=head_dim, head_dim=head_dim, page_size=16, seq_lens=(0, 3, 300, 700), kv_dtype=kv, q_dtype=q,
                num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, backend=backend, splitk="3")
    plan = attn.plan(4)
    assert plan.arm == "splitk" and plan.workspace.head_dim == head_dim
    check_against_reference(p, *run_poisoned(attn, p))
    if backend == "cpu":
        _check_workspace_partials(attn, p, splits=3)


def test_a_padded_head_dim_serves_multi_token_decode_with_a_window_sinks_a_soft_cap_and_fp32_out(backend):
    p = problem(seed=7, head_dim=112, page_size=5, seq_lens=(3, 60, 200), num_q_heads=4, num_kv_heads=1,
                kv_dtype="fp8")
    q = np.random.default_rng(7).standard_normal((3, 2, 4, 112)).astype(p.q.dtype)
    sinks = np.random.default_rng(8).normal(0, 2, 4).astype(np.float32)
    features = dict(window_left=50, logits_soft_cap=15.0)
    attn = decoder(p, backend=backend, max_q_len=2, sinks=True, out_dtype="float32", splitk="off", **features)
    out, lse = run_poisoned(attn, p, q=q, sinks=sinks, out_dtype=np.float32)
    ref_out, ref_lse = p.reference(return_lse=True, q=q, sinks=sinks, **features)
    np.testing.assert_allclose(out, ref_out, rtol=2e-6, atol=2e-6 * p.v_absmax())
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


def test_at_a_padded_head_dim_a_heads_bytes_do_not_depend_on_its_batch_or_its_cta():
    p = problem(seed=5, head_dim=80, page_size=16, seq_lens=(300, 5, 41, 0), num_q_heads=8, num_kv_heads=2)
    full = {h: run_poisoned(decoder(p, heads_per_cta=h, splitk="auto"), p) for h in (1, 2, 4)}
    check_against_reference(p, *full[1])
    for out, lse in full.values():
        assert out.tobytes() == full[1][0].tobytes() and lse.tobytes() == full[1][1].tobytes()
    from metrale_attn.problems import Problem

    alone = Problem(p.q[2:3], p.k_cache, p.v_cache, p.block_tables[2:3], p.seq_lens[2:3], p.k_scale, p.v_scale,
                    p.kv_layout)
    out, lse = run_poisoned(decoder(alone, max_batch=4, splitk="auto"), alone)
    assert out[0].tobytes() == full[1][0][2].tobytes() and lse[0].tobytes() == full[1][1][2].tobytes()


def test_from_head_dim_208_a_cta_holds_one_row_tile_so_nothing_spills():
    """16 rows at 240 left ptxas at 255 registers and plain split-K spilled on sm_120; every
    feature with fp16 q spilled at 224 in a 99 KiB target's 2-warp tiling and at 208 on sm_100."""
    assert [max_rows_per_cta(d) for d in (64, 176, 192, 208, 224, 256)] == [16, 16, 16, 8, 8, 8]
    assert KernelSpec("splitk", 192, "bf16", "bf16", "mma", 2).max_rows == 16
    with pytest.raises(ValueError, match="row_tiles"):
        KernelSpec("splitk", 208, "bf16", "bf16", "mma", 2)


@pytest.mark.parametrize("head_dim", [0, 32, 40, 48, 72, 100, 264, 272, 384, 528, 576, 1024])
def test_any_other_head_dim_is_refused_naming_head_dim_and_the_supported_ones(head_dim):
    with pytest.raises(ValueError, match=rf"head_dim must be a multiple of 16 from 64 to 256 \(64, 80, .*, 256\) or "
                       rf"512 \(the simt kernels only\), got {head_dim}"
                       if head_dim else "head_dim must be a positive int"):
        ModelShape(4, 2, head_dim)


def test_simt_chosen_by_argument_or_environment_refuses_a_head_dim_it_lacks(monkeypatch):
    p = problem(seq_lens=(5,), head_dim=96)
    message = r"impl='simt' has no head_dim 96 \(the simt kernels take head_dim 64, 128, 256, 512\)"
    with pytest.raises(ValueError, match=message):
        decoder(p, impl="simt")
    monkeypatch.setenv(ENV_IMPL, "simt")
    with pytest.raises(ValueError, match=message):
        decoder(p)
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("unpacked", 96, "bf16", "bf16", "simt")


class _DisagreeingDevice(CpuBackend):
    """A backend whose known-answer test of the mma instructions fails."""

    def verify_mma(self):
        return ["mma.m16n8k16 bf16"]


def test_a_failed_self_test_never_falls_back_to_simt_at_a_head_dim_simt_lacks():
    with pytest.raises(RuntimeError, match=r"only they serve .*head_dim 80 \(the simt kernels take"):
        decoder(problem(seq_lens=(5,), head_dim=80), backend=_DisagreeingDevice())
    with pytest.warns(RuntimeWarning, match="using impl='simt'"):  # 64, 128, 256 (and 512) still fall back
        assert decoder(problem(seq_lens=(5,), head_dim=128), backend=_DisagreeingDevice()).impl == "simt"


def test_spec_names_carry_the_real_head_dim_and_the_tiling_sizes_rows_at_the_padded_one():
    assert KernelSpec("splitk", 80, "bf16", "fp8", "mma", 2).name == "decode_splitk_qbf16_kvfp8_hd80_r16"
    for d in PADDED:
        for kv in ("bf16", "fp8"):
            assert mma_tiling(d, "bf16", kv, 1) == mma_tiling(d + 16, "bf16", kv, 1)
            assert KernelSpec("unpacked", d, "bf16", kv).defines()["PD_HEAD_DIM"] == d


def test_precompile_of_a_hugging_face_config_at_head_dim_80_builds_the_mma_kernels_and_no_simt_fallback():
    raw = json.loads((pathlib.Path(__file__).parent / "hf_configs" / "llama-3-8b.json").read_text())
    raw.update(head_dim=80, hidden_size=2560)
    model = hf_config.from_dict(raw)
    assert model.head_dim == 80
    plan = needed_specs(layers_of(model), TARGETS["hopper"], Options(), environ={})
    names = [n.name for n in plan.needed]
    assert names[0] == "pd_selftest" and all("_hd80_" in n for n in names[1:]) and len(names) > 1
    assert not any(n.startswith("simt_") for n in names)


def test_gb10_runs_head_dim_112_on_mma_with_a_ring_sized_for_its_99_kib():
    p = problem(seq_lens=(5, 40), head_dim=112)
    attn = decoder(p, target="gb10")
    assert attn.plan(2).impl == "mma"
    check_against_reference(p, *run_poisoned(attn, p))


def test_where_the_mma_kernels_cannot_run_a_head_dim_simt_lacks_is_refused_naming_it():
    """An fp8 cache on a10 (sm_86: no fp8 cvt) at head dim 112, which simt cannot take over."""
    message = r"lacks \(sm_89 and later have it\): they cannot launch there \(impl='simt' has no head_dim 112"
    with pytest.raises(ValueError, match=message):
        decoder(problem(seq_lens=(5,), head_dim=112, kv_dtype="fp8"), target="a10")
    with pytest.raises(ValueError, match=message):
        needed_specs([Layer("layer", 4, 4, 112)], TARGETS["a10"], Options(kv_dtype="fp8_e4m3"), environ={})


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [d for d in HEAD_DIMS if d not in SIMT_HEAD_DIMS])
def test_every_new_head_dim_arm_and_dtype_pair_holds_the_one_ulp_bar(backend, head_dim, q, kv, arm):
    """The whole grid at the head dims test_decode's grid leaves out (``slow``)."""
    p = problem(seed=head_dim + len(kv), head_dim=head_dim, page_size=(1, 16, 7)[head_dim // 16 % 3],
                seq_lens=(0, 1, 40, 300), kv_dtype=kv, q_dtype=q, layout=("NHD", "HND")[len(q + kv) % 2],
                num_q_heads=6, num_kv_heads=2)
    attn = decoder(p, backend=backend, splitk="off" if arm == "unpacked" else "3")
    assert attn.plan(4).arm == arm
    check_against_reference(p, *run_poisoned(attn, p))


# -- head dim 512: the simt kernels alone (Gemma 4's global layers) ---------------------------------

WIDE = 512
GEMMA4_GLOBAL = dict(num_q_heads=16, num_kv_heads=2)
"""Gemma-4-26B-A4B's global layers at one rank: 16 query heads on 2 KV heads (a group of 8)."""


def _wide(**kwargs):
    """A decoder of a 512-wide problem with the default impl, whose fallback warning is expected."""
    with pytest.warns(RuntimeWarning, match=r"head_dim 512 is wider than the mma core's 64\.\.256; using "
                                            r"impl='simt' instead"):
        return decoder(**kwargs)


@pytest.mark.parametrize("arm, kv, q, page_size, layout, sm_scale", [
    ("unpacked", "bf16", "bf16", 16, "NHD", 1.0),  # Gemma 4: sm_scale 1 (q and k are RMS-normed)
    ("unpacked", "fp8", "fp16", 7, "HND", None),
    ("splitk", "bf16", "fp16", 1, "HND", None),
    ("splitk", "fp8", "bf16", 16, "NHD", 1.0),
    ("splitk", "fp16", "bf16", 7, "NHD", None),
])
def test_at_head_dim_512_the_default_impl_runs_simt_on_every_arm_within_one_ulp_with_lse(backend, arm, kv, q,
                                                                                       page_size, layout, sm_scale):
    p = problem(seed=WIDE + page_size, head_dim=WIDE, page_size=page_size, seq_lens=(0, 1, 2 * page_size + 1, 300),
                kv_dtype=kv, q_dtype=q, layout=layout, share_prefix_pages=1, **GEMMA4_GLOBAL)
    attn = _wide(p=p, backend=backend, sm_scale=sm_scale, splitk="off" if arm == "unpacked" else "3")
    plan = attn.plan(4)
    assert (attn.impl, plan.arm, plan.impl, plan.heads_per_cta) == ("simt", arm, "simt", 1)
    check_against_reference(p, *run_poisoned(attn, p), sm_scale=sm_scale)


def test_at_head_dim_512_the_split_k_workspace_holds_the_reference_partials_in_slots_of_514_floats(backend):
    p = problem(seed=3, head_dim=WIDE, page_size=16, seq_lens=(0, 3, 300, 700), kv_dtype="fp8", num_q_heads=2,
                num_kv_heads=1)
    attn = _wide(p=p, backend=backend, splitk="3")
    plan = attn.plan(4)
    assert plan.arm == "splitk" and plan.workspace.slot_floats == WIDE + 2
    check_against_reference(p, *run_poisoned(attn, p))
    if backend == "cpu":
        _check_workspace_partials(attn, p, splits=3)


def test_at_head_dim_512_the_gqa_pack_does_not_apply_and_the_unpacked_arm_serves_the_group(backend):
    """The packed arm's rule is its PD_HDIM, 256 (6 q vectors and accumulators of 16 floats a
    thread would not fit its registers at 512): the plan says so and takes the unpacked arm."""
    p = problem(seed=11, head_dim=WIDE, page_size=16, seq_lens=(5, 40), num_q_heads=6, num_kv_heads=1)
    attn = _wide(p=p, backend=backend, splitk="off", gqa_pack=True)
    assert attn.plan(2).arm == "unpacked" and "GQA pack on but the shape does not fit" in attn.plan(2).reason
    check_against_reference(p, *run_poisoned(attn, p))


def test_at_head_dim_512_a_sequences_bytes_do_not_depend_on_its_batch_its_position_or_the_thread_order():
    p = problem(seed=5, head_dim=WIDE, page_size=16, seq_lens=(700, 3, 0, 300, 41), kv_dtype="bf16",
                share_prefix_pages=1, **GEMMA4_GLOBAL)
    for splitk in ("auto", "off"):
        attn = _wide(p=p, max_batch=5, splitk=splitk)
        full = run_poisoned(attn, p)
        check_against_reference(p, *full)
        for rows in ([3], [4, 0], [1, 3, 0], [0, 2, 4, 1, 3]):
            out, lse = run_poisoned(attn, pick(p, rows))
            for at, r in enumerate(rows):
                assert out[at].tobytes() == full[0][r].tobytes() and lse[at].tobytes() == full[1][r].tobytes()
        short = pick(p, [1, 4])  # the thread orders on a short pair (every thread still runs)
        base = run_poisoned(attn, short)
        for order in ("shuffle:1", "warp-ahead:7"):
            got = run_poisoned(_wide(p=short, backend=CpuBackend(order=order), max_batch=5, splitk=splitk), short)
            assert [a.tobytes() for a in got] == [a.tobytes() for a in base], (splitk, order)


def test_impl_mma_chosen_at_head_dim_512_is_refused_naming_head_dim_and_what_mma_takes(monkeypatch):
    p = problem(seq_lens=(5,), head_dim=WIDE)
    message = (r"impl='mma' has no head_dim 512 \(the mma kernels take every multiple of 16 from 64 to 256\): use "
               r"impl='simt', or leave impl and METRALE_ATTN_DECODE_IMPL unset")
    with pytest.raises(ValueError, match=message):
        decoder(p, impl="mma")
    monkeypatch.setenv(ENV_IMPL, "mma")
    with pytest.raises(ValueError, match=message):
        decoder(p)
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("unpacked", WIDE, "bf16", "bf16", "mma")
    monkeypatch.setenv(ENV_IMPL, "simt")  # chosen simt: no fallback to say
    assert decoder(p).impl == "simt"


@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
def test_at_head_dim_512_both_arms_run_clean_under_address_sanitizer(arm):
    """The 32-byte row slices of a bf16 cache read nothing past any array (each shipped at its
    exact size, in a child process)."""
    p = problem(seed=9, head_dim=WIDE, page_size=7, seq_lens=(0, 1, 300), kv_dtype="bf16", layout="HND",
                num_q_heads=2, num_kv_heads=1)
    attn = _wide(p=p, backend=CpuBackend(asan=True), splitk="off" if arm == "unpacked" else "3")
    check_against_reference(p, *run_poisoned(attn, p))


class _NoSelfTest(CpuBackend):
    """A backend whose self-test must not run."""

    def verify_mma(self):
        raise AssertionError("the mma self-test ran for a layer the mma core has no kernel of")


def test_at_head_dim_512_the_fallback_is_the_shapes_whatever_the_device_and_asks_no_self_test():
    p = problem(seq_lens=(5,), head_dim=WIDE)
    assert _wide(p=p, backend=_NoSelfTest()).impl == "simt"
    assert _wide(p=p, backend=_DisagreeingDevice()).impl == "simt"  # the head dim's reason, not the device's
    with pytest.raises(ValueError, match=r"head_dim 512 is wider than the mma core's 64\.\.256: they cannot launch "
                                         r"there \(impl='simt' has no sinks, window\)"):
        decoder(p, sinks=True, window_left=8)


@pytest.mark.slow
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
@pytest.mark.parametrize("kv", ["bf16", "fp16", "fp8"])
@pytest.mark.parametrize("q", ["bf16", "fp16"])
@pytest.mark.parametrize("page_size", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("heads", [(16, 2), (8, 1), (16, 1), (4, 4)], ids=["g8", "g8-one-kv", "g16", "mha"])
def test_at_head_dim_512_every_arm_dtype_pair_page_size_and_group_holds_the_one_ulp_bar(backend, heads, page_size, q,
                                                                                        kv, arm):
    """The whole grid at 512 (``slow``): Gemma 4's groups of 8 and MLA-like single-KV-head groups."""
    p = problem(seed=page_size + len(kv + q), head_dim=WIDE, page_size=page_size,
                seq_lens=(0, 1, page_size + 1, 300, 1100), kv_dtype=kv, q_dtype=q,
                layout=("NHD", "HND")[len(q + kv) % 2], num_q_heads=heads[0], num_kv_heads=heads[1])
    attn = _wide(p=p, backend=backend, sm_scale=(None, 1.0)[page_size % 2], splitk="off" if arm == "unpacked" else "auto")
    assert attn.plan(5).arm == arm
    check_against_reference(p, *run_poisoned(attn, p), sm_scale=(None, 1.0)[page_size % 2])


def _check_workspace_partials(attn, p, splits: int) -> None:
    """The CPU backend's workspace holds the reference's split-K partials, slot by slot: each
    ``head_dim + 2`` fp32 (the real dim's accumulator, then m and l), padding never in it."""
    n, h, d = p.q.shape
    ws = attn.workspace[: n * h * splits * (d + 2)].reshape(n, h, splits, d + 2).astype(np.float64)
    ref = reference.splitk_partials(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, splits,
                                    kv_layout=p.kv_layout, k_scale=p.k_scale, v_scale=p.v_scale)
    seen = ref[..., -1] != 0
    np.testing.assert_allclose(ws[seen], ref[seen], rtol=1e-5, atol=1e-5)
