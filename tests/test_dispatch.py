"""Policy wiring through DecodeAttention, and the refusals that happen before any launch."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn import DecodeAttention
from metrale_attn.backends import cuda_available

from conftest import CountingBackend, decoder, problem, run_poisoned


def test_the_environment_pins_the_split_count_exactly_as_the_seed_says(monkeypatch):
    p = problem(seq_lens=(10,))
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", " 4 ")
    assert decoder(p).plan(1).num_splits == 4
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "OFF")
    assert decoder(p).plan(1).arm == "unpacked"
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "legacy")
    assert decoder(p).plan(1).num_splits == 132 // 4 and decoder(p).defaults.splitk.kind == "legacy"


def test_an_unparseable_environment_value_keeps_the_targets_declaration(monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_DECODE_SPLITK", "many")
    attn = decoder(problem(seq_lens=(10,)))
    assert attn.defaults.splitk.label() == "auto" and attn.plan(1).num_splits == 16  # 2*132/4 capped


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


def test_a_split_run_launches_the_split_kernel_then_the_merge():
    p = problem(seq_lens=(10, 300))
    be = CountingBackend()
    run_poisoned(decoder(p, backend=be, splitk="3"), p)
    assert be.launches == ["paged_decode_splitk", "paged_decode_splitk_merge"]


# -- refusals ---------------------------------------------------------------

P = problem(seq_lens=(5, 40), head_dim=64, page_size=16)


def _with(array, index, value):
    changed = array.copy()
    changed[index] = value
    return changed


def _refused(match, **changes):
    be = CountingBackend()
    attn = decoder(P, backend=be, max_batch=2)
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


def test_a_misaligned_stride_is_refused_before_any_launch():
    wide = np.zeros((2, 4, 68), dtype=P.q.dtype)
    _refused("strides must be multiples of 8 elements", q=wide[:, :, :64])


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(page_size=0), "page_size"), (dict(page_size=300), "page_size"), (dict(max_batch=0), "max_batch"),
     (dict(kv_layout="NDH"), "kv_layout"), (dict(q_dtype="fp8"), "q_dtype"), (dict(kv_dtype="int8"), "kv_dtype"),
     (dict(head_dim=96), "head_dim"), (dict(num_q_heads=5), "multiple of num_kv_heads"),
     (dict(splitk="sometimes"), "splitk"), (dict(sm_scale=-1.0), "sm_scale"), (dict(backend="tpu"), "backend"),
     (dict(target="a100"), "target")],
)
def test_a_bad_construction_is_refused_with_the_argument_named(kwargs, match):
    base = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, q_dtype="bfloat16", kv_dtype="bfloat16",
                max_batch=4, backend="cpu")
    base.update(kwargs)
    args = [base.pop(k) for k in ("num_q_heads", "num_kv_heads", "head_dim", "page_size")]
    with pytest.raises(ValueError, match=match):
        DecodeAttention(*args, **base)


def test_construction_compiles_every_arm_the_policy_can_reach_so_run_never_compiles():
    attn = decoder(problem(seq_lens=(10,)), splitk="legacy", target="gb10", max_batch=64)
    assert sorted(attn._modules) == ["splitk", "unpacked"]
    assert sorted(decoder(problem(seq_lens=(10,)), splitk="auto")._modules) == ["splitk"]


@pytest.mark.skipif(cuda_available(), reason="a GPU is present")
def test_asking_for_the_cupy_backend_without_a_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="backend 'cupy' needs"):
        decoder(problem(seq_lens=(3,)), backend="cupy")
