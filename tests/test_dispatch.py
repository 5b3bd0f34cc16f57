"""Policy wiring through DecodeAttention, and the refusals that happen before any launch."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import DecodeAttention
from metrale_attn.backends import cuda_available, get_backend
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import CountingBackend, check_against_reference, decoder, problem, run_poisoned


def test_the_environment_pins_the_split_count_exactly_as_the_seed_says(monkeypatch):
    p = problem(seq_lens=(10,))
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", " 4 ")
    assert decoder(p).plan(1).num_splits == 4
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "OFF")
    assert decoder(p).plan(1).arm == "unpacked"
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "legacy")
    assert decoder(p).plan(1).num_splits == 132 // 4 and decoder(p).target_policy.splitk.kind == "legacy"


def test_an_unparseable_environment_value_keeps_the_targets_declaration(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "many")
    attn = decoder(problem(seq_lens=(10,)))
    assert attn.target_policy.splitk.label() == "auto" and attn.plan(1).num_splits == 16  # 2*132/4 capped


def test_the_gqa_pack_environment_arms_the_packed_kernel_on_the_one_split_arm(monkeypatch):
    p = problem(seq_lens=(10,), num_q_heads=6, num_kv_heads=1, head_dim=256)
    monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "on")
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "0")
    assert decoder(p).plan(1).arm == "gqa_packed"
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "auto")
    assert decoder(p).plan(1).arm == "splitk"


def test_an_unparseable_gqa_pack_value_keeps_it_off(monkeypatch):
    p = problem(seq_lens=(10,), num_q_heads=6, num_kv_heads=1, head_dim=256)
    monkeypatch.setenv("METRALE_ATTN_DECODE_GQA_PACK", "sure")
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "off")
    assert decoder(p).plan(1).arm == "unpacked"


def test_arguments_override_the_environment(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "4")
    assert decoder(problem(seq_lens=(10,)), splitk="2").plan(1).num_splits == 2


@pytest.mark.parametrize("impl, kernels", [("mma", ["decode_splitk", "decode_splitk_merge"]),
                                           ("simt", ["simt_decode_splitk", "simt_decode_splitk_merge"])])
def test_a_split_run_launches_the_split_kernel_then_the_merge(impl, kernels, counting_backend):
    p = problem(seq_lens=(10, 300))
    run_poisoned(decoder(p, backend=counting_backend, splitk="3", impl=impl), p)
    assert counting_backend.launches == kernels


# -- refusals ---------------------------------------------------------------

P = problem(seq_lens=(5, 40), head_dim=64, page_size=16)


def _with(array, index, value):
    changed = array.copy()
    changed[index] = value
    return changed


def _refused(match, options=None, **changes):
    be = CountingBackend()
    attn = decoder(P, backend=be, max_batch=2, **(options or {}))
    args = dict(q=P.q, k_cache=P.k_cache, v_cache=P.v_cache, block_tables=P.block_tables, seq_lens=P.seq_lens)
    args.update(changes)
    extra = {k: args.pop(k) for k in list(args) if k not in ("q", "k_cache", "v_cache", "block_tables", "seq_lens")}
    with pytest.raises((ValueError, TypeError), match=match):
        attn.run(args["q"], args["k_cache"], args["v_cache"], args["block_tables"], args["seq_lens"], **extra)
    assert be.launches == []


@pytest.mark.parametrize(
    "match, changes",
    [
        ("q must have shape", dict(q=P.q[:, :3])),
        ("q must hold bf16", dict(q=P.q.astype(np.float16))),
        ("q must be contiguous in its last dim", dict(q=np.asfortranarray(P.q))),
        ("max_batch=2", dict(q=np.concatenate([P.q, P.q[:1]]))),
        ("k_cache must be NHD", dict(k_cache=P.k_cache[:, :8])),
        ("v_cache must hold bf16", dict(v_cache=P.v_cache.astype(np.float16))),
        ("k_cache and v_cache must have the same shape", dict(v_cache=P.v_cache[:3])),
        ("block_tables must be int32", dict(block_tables=P.block_tables.astype(np.int64))),
        ("block_tables must be int32", dict(block_tables=P.block_tables[:1])),
        ("seq_lens must be contiguous int32", dict(seq_lens=P.seq_lens.astype(np.int64))),
        ("seq_lens\\[1\\] = 100000", dict(seq_lens=np.array([5, 100000], np.int32))),
        ("seq_lens\\[0\\] = -1", dict(seq_lens=np.array([-1, 40], np.int32))),
        ("block_tables\\[1, 2\\] = 1000000", dict(block_tables=_with(P.block_tables, (1, 2), 10**6))),
        ("block_tables\\[0, 0\\] = -1", dict(block_tables=_with(P.block_tables, (0, 0), -1))),
        ("out must be a contiguous", dict(out=np.empty((2, 4, 32), np.float16))),
        ("out must hold bf16", dict(out=np.empty((2, 4, 64), np.float16))),
        ("lse must be a contiguous float32", dict(lse=np.empty((2, 4), np.float64))),
        ("k_scale must be a finite float > 0", dict(k_scale=float("nan"))),
        ("v_scale must be a finite float > 0", dict(v_scale=0.0)),
        ("k_scale must be a Python or NumPy float", dict(k_scale="1")),
        ("q must be a NumPy array", dict(q=P.q.tolist())),
        ("stream must be None on the cpu backend", dict(stream=7)),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_bad_input_is_refused_with_the_argument_named_before_any_launch(match, changes):
    _refused(match, **changes)


@pytest.mark.parametrize(
    "match, options, scales",
    [
        (r"k_scale = 1e\+39 .*log2\(e\) = 1\.8\d*e\+38", {}, dict(k_scale=1e39)),
        (r"k_scale = 3e\+38 \(with sm_scale = 10, .*log2\(e\) = 4\.3\d*e\+39", dict(sm_scale=10.0),
         dict(k_scale=3e38)),
        (r"k_scale = inf .*log2\(e\) = inf", {}, dict(k_scale=10**400)),
        (r"k_scale = 1e-45 .*log2\(e\) = 1\.8\d*e-46", {}, dict(k_scale=1e-45)),
        (r"v_scale = 1e\+39 must be a finite normal fp32 value", {}, dict(v_scale=1e39)),
    ],
    ids=["k_scale=1e39", "sm_scale=10,k_scale=3e38", "k_scale=10**400", "subnormal", "v_scale=1e39"],
)
def test_scales_outside_fp32_once_folded_are_refused_naming_the_argument_and_the_folded_value(match, options, scales):
    """They pass "finite > 0" but the kernels' fp32 logit scale (or v_scale) is inf or
    subnormal: the output would be all NaN (or inf) with no error."""
    _refused(match, options, **scales)


def _buffer_views(*shapes_and_dtypes, offsets):
    """Arrays of the given shapes and dtypes at byte ``offsets`` inside one buffer."""
    buf = np.zeros(1 << 16, np.uint8)
    return [buf[off:off + int(np.prod(shape)) * np.dtype(dt).itemsize].view(dt).reshape(shape)
            for (shape, dt), off in zip(shapes_and_dtypes, offsets)]


OUT_SHAPE, LSE_SHAPE = ((2, 4, 64), P.q.dtype), ((2, 4), np.float32)


def _lse_over_seq_lens():
    lens = np.zeros(8, np.int32)
    lens[:2] = P.seq_lens
    return dict(seq_lens=lens[:2], lse=lens.view(np.float32).reshape(2, 4))


@pytest.mark.parametrize(
    "match, changes",
    [
        ("lse overlaps out", dict(zip(("out", "lse"), _buffer_views(OUT_SHAPE, LSE_SHAPE, offsets=(0, 512))))),
        ("lse overlaps out", dict(zip(("lse", "out"), _buffer_views(LSE_SHAPE, OUT_SHAPE, offsets=(0, 16))))),
        ("out overlaps q", dict(out=P.q.copy(), q=None)),
        ("out overlaps k_cache", dict(out=P.k_cache.reshape(-1)[:512].reshape(2, 4, 64))),
        ("lse overlaps seq_lens", _lse_over_seq_lens()),
    ],
    ids=["lse-inside-out", "out-straddles-lse", "out-is-q", "out-inside-k_cache", "lse-over-seq_lens"],
)
def test_outputs_that_overlap_each_other_or_an_input_are_refused_before_any_launch(match, changes):
    if changes.get("q", 0) is None:  # out is q itself: the one overlap that happens to work today
        changes["q"] = changes["out"]
    _refused(match, **changes)


def test_outputs_carved_side_by_side_from_one_buffer_are_accepted():
    out, lse = _buffer_views(OUT_SHAPE, LSE_SHAPE, offsets=(0, 1024))  # lse starts right past out's last byte
    run = decoder(P, max_batch=2).run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, out=out, lse=lse)
    check_against_reference(P, *run)


@pytest.mark.parametrize("name", ["out", "lse"])
def test_a_read_only_out_or_lse_is_refused_before_any_launch(name):
    array = np.empty((2, 4, 64), P.q.dtype) if name == "out" else np.empty((2, 4), np.float32)
    array.flags.writeable = False
    _refused(f"{name} must be writable", **{name: array})


@pytest.mark.parametrize(
    "match, changes",
    [
        (r"q has negative strides \[-256, 64, 1\]", dict(q=P.q[::-1])),
        (r"k_cache has negative strides", dict(k_cache=P.k_cache[::-1])),
        (r"block_tables has negative strides", dict(block_tables=P.block_tables[::-1])),
        (r"seq_lens has negative strides", dict(seq_lens=P.seq_lens[::-1])),
        (r"seq_lens must be contiguous int32 \[2\], got a strided view \(element stride 2",
         dict(seq_lens=np.repeat(P.seq_lens, 2)[::2])),
        (r"block_tables .* strides \[\d+, 2\] \(a row's page ids must be adjacent",
         dict(block_tables=np.repeat(P.block_tables, 2, axis=1)[:, ::2])),
    ],
    ids=["q", "k_cache", "block_tables", "seq_lens", "strided-seq_lens", "strided-block_tables"],
)
def test_negative_strides_and_strided_index_arrays_are_refused_naming_the_cause(match, changes):
    _refused(match, **changes)


def test_block_tables_with_no_columns_are_accepted_when_every_sequence_is_empty():
    empty = problem(seq_lens=(0, 0), head_dim=64, page_size=16)
    out, lse = decoder(empty).run(empty.q, empty.k_cache, empty.v_cache, np.zeros((2, 0), np.int32),
                                  empty.seq_lens, return_lse=True)
    assert not out.astype(np.float32).any() and np.isneginf(lse).all()


def test_block_tables_with_no_columns_but_a_nonempty_sequence_are_refused_saying_so():
    _refused(r"block_tables has 0 columns but seq_lens\[0\] = 5", block_tables=np.zeros((2, 0), np.int32))


def test_a_misaligned_stride_is_refused_before_any_launch():
    wide = np.zeros((2, 4, 68), dtype=P.q.dtype)
    _refused("strides must be multiples of 8 elements", q=wide[:, :, :64])


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(page_size=0), "page_size"), (dict(page_size=300), "page_size"), (dict(max_batch=0), "max_batch"),
     (dict(kv_layout="NDH"), "kv_layout"), (dict(q_dtype="fp8"), "q_dtype"), (dict(kv_dtype="int8"), "kv_dtype"),
     (dict(head_dim=72), "head_dim"), (dict(num_q_heads=5), "multiple of num_kv_heads"),
     (dict(splitk="sometimes"), "splitk"), (dict(sm_scale=-1.0), "sm_scale"), (dict(backend="tpu"), "backend"),
     (dict(target="v100"), "target")],
)
def test_a_bad_construction_is_refused_with_the_argument_named(kwargs, match):
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, q_dtype="bfloat16", kv_dtype="bfloat16",
                max_batch=4, backend="cpu")
    base.update(kwargs)
    args = [base.pop(k) for k in ("num_q_heads", "num_kv_heads", "head_dim", "page_size")]
    with pytest.raises(ValueError, match=match):
        DecodeAttention(*args, **base)


def test_the_kv_layout_is_trimmed_and_case_folded_like_every_other_string_option():
    p = problem(seq_lens=(30,), layout="HND")
    attn = DecodeAttention(4, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", kv_layout=" hnd ", max_batch=1, backend="cpu")
    assert attn.kv_layout == "HND"
    out, lse = run_poisoned(attn, p)
    check_against_reference(p, out, lse)


def test_numpy_integers_are_accepted_wherever_an_int_is_taken():
    attn = DecodeAttention(np.int64(4), np.int32(2), np.int64(64), np.int64(16), q_dtype="bf16", kv_dtype="bf16",
                           max_batch=np.int64(2), max_decode_seqs=np.int16(1), backend="cpu")
    assert (attn.shape.num_q_heads, attn.page_size, attn.max_batch) == (4, 16, 2)
    assert type(attn.shape.num_q_heads) is int and type(attn.max_batch) is int
    assert attn.plan(np.int64(2)).num_seqs == 2
    check_against_reference(P, *attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens, return_lse=True))


@pytest.mark.parametrize("name", ["num_q_heads", "page_size", "max_batch"])
def test_bools_are_still_refused_where_an_int_is_taken(name):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, max_batch=2)
    args[name] = True
    with pytest.raises(ValueError, match=name):
        DecodeAttention(**args, q_dtype="bf16", kv_dtype="bf16", backend="cpu")


class _ScarceMemory(CpuBackend):
    """A host that cannot give more than 1 GiB at once (whatever this machine's overcommit policy)."""

    def empty(self, shape, dtype, like=None):
        if np.prod(shape) * np.dtype(dtype).itemsize > 1 << 30:
            raise MemoryError(f"Unable to allocate array with shape {shape}")
        return super().empty(shape, dtype, like)


def test_a_workspace_too_large_to_allocate_says_its_bytes_and_what_to_lower():
    with pytest.raises(MemoryError, match=r"workspace of 1056768000000 bytes .* max_batch=1000000.*lower max_batch"):
        DecodeAttention(64, 8, 256, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=10**6, splitk="16",
                        backend=_ScarceMemory())


def test_construction_compiles_every_variant_the_policy_can_reach_so_run_never_compiles():
    p = problem(seq_lens=(10,))
    be = CountingBackend()
    attn = decoder(p, backend=be, splitk="legacy", max_batch=64)  # 33 splits at batch 1, one at 64
    assert sorted(be.loaded) == ["decode_splitk_qbf16_kvbf16_hd64_r8", "decode_unpacked_qbf16_kvbf16_hd64_r8"]
    for n in (1, 64):
        attn.run(p.q[:1].repeat(n, 0), p.k_cache, p.v_cache, p.block_tables[:1].repeat(n, 0), p.seq_lens[:1].repeat(n))
    assert len(be.loaded) == 2 and be.launches
    be = CountingBackend()
    decoder(p, backend=be, splitk="auto")
    assert be.loaded == ["decode_splitk_qbf16_kvbf16_hd64_r8"]


def test_a_group_of_sixteen_compiles_both_row_tiles_unless_heads_per_cta_is_pinned():
    p = problem(seq_lens=(10,), num_q_heads=16, num_kv_heads=1)
    be = CountingBackend()
    decoder(p, backend=be, splitk="off")
    assert sorted(be.loaded) == ["decode_unpacked_qbf16_kvbf16_hd64_r16", "decode_unpacked_qbf16_kvbf16_hd64_r8"]
    be = CountingBackend()
    decoder(p, backend=be, splitk="off", heads_per_cta=16)
    assert be.loaded == ["decode_unpacked_qbf16_kvbf16_hd64_r16"]


@pytest.mark.skipif(cuda_available(), reason="a GPU is present")
def test_asking_for_the_cupy_backend_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="backend 'cupy' needs"):
        decoder(problem(seq_lens=(3,)), backend="cupy")


class _DisagreeingDevice(CpuBackend):
    """A backend whose known-answer test of the mma instructions fails."""

    def verify_mma(self):
        return ["mma.m16n8k16 bf16"]


def test_a_device_whose_instructions_disagree_with_their_emulation_falls_back_to_simt_with_one_warning():
    p = problem(seq_lens=(40,))
    with pytest.warns(RuntimeWarning, match="mma.m16n8k16 bf16 disagree .* using impl='simt'"):
        attn = decoder(p, backend=_DisagreeingDevice())
    assert attn.impl == "simt" and attn.plan(1).impl == "simt"
    check_against_reference(p, *run_poisoned(attn, p))
    with pytest.raises(RuntimeError, match="only they serve the features"):
        decoder(p, backend=_DisagreeingDevice(), sinks=True)


def test_the_known_answer_test_agrees_with_the_cpu_emulation(backend):
    """On a GPU the same test decides whether the mma kernels are trusted (backends/selftest.py)."""
    from metrale_attn.backends import selftest

    assert selftest.run(get_backend(backend)) == []


def test_the_known_answer_test_names_the_instruction_whose_bits_differ():
    from metrale_attn.backends import selftest

    words, floats = selftest.expected(selftest.inputs())
    assert selftest.disagreements(words, floats) == []
    bad = words.copy()
    bad[3, 1] ^= 1  # one bit of one lane's second ldmatrix register
    worse = floats.copy()
    worse[0, 5] += 1.0  # an fp16 MMA result one off
    assert selftest.disagreements(bad, worse) == ["ldmatrix.x4", "mma.m16n8k16 f16"]
