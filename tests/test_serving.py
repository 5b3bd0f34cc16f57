"""What a serving loop relies on beyond one call: batch buckets padded with empty rows (one CUDA
graph per bucket), and tensor parallelism (heads sharded across ranks)."""

from __future__ import annotations

import numpy as np
import pytest

from cuda_on_cpu import asan
from metrale_attn import DecodeAttention
from metrale_attn.problems import GARBAGE_PAGE_ID, Problem
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import check_against_reference, decoder, problem, run_poisoned

BUCKET = 8


def _padded(p: Problem, real: int, bucket: int = BUCKET) -> Problem:
    """``p``'s first ``real`` rows, padded to ``bucket`` rows as a serving loop pads a batch for
    its bucket's graph: seq_len 0, block-table rows of page ids far outside the pool (any read
    of one would fault), q rows of NaN (their values must not matter)."""
    q = np.full((bucket,) + p.q.shape[1:], np.nan, p.q.dtype)
    q[:real] = p.q[:real]
    tables = np.full((bucket, p.block_tables.shape[1]), GARBAGE_PAGE_ID, np.int32)
    tables[:real] = p.block_tables[:real]
    lens = np.zeros(bucket, np.int32)
    lens[:real] = p.seq_lens[:real]
    return Problem(q, p.k_cache, p.v_cache, tables, lens, p.k_scale, p.v_scale, p.kv_layout)


P = problem(seed=11, seq_lens=(700, 37, 1, 300, 16, 255, 90, 5), num_q_heads=8, num_kv_heads=2, kv_dtype="fp8")


@pytest.mark.parametrize("splitk", ["auto", "4", "off"])
def test_a_buckets_plan_and_its_real_rows_bytes_do_not_depend_on_how_many_rows_are_padding(splitk):
    attn = decoder(P, splitk=splitk, max_batch=BUCKET)
    plan = attn.plan(BUCKET)
    alone = {}
    for real in (1, 3, 8):
        padded = _padded(P, real)
        assert attn.plan(len(padded.seq_lens)) is plan  # the plan reads the bucket's size only
        out, lse = run_poisoned(attn, padded)
        check_against_reference(padded, out, lse)
        assert not out[real:].astype(np.float32).any() and np.isneginf(lse[real:]).all()  # zeros, -inf
        for row in range(real):
            alone.setdefault(row, out[row].tobytes())
            assert out[row].tobytes() == alone[row]  # whatever the padding
    solo = Problem(P.q[:1], P.k_cache, P.v_cache, P.block_tables[:1], P.seq_lens[:1], P.k_scale,
                             P.v_scale, P.kv_layout)
    assert run_poisoned(decoder(P, splitk=splitk, max_batch=BUCKET), solo)[0][0].tobytes() == alone[0]


@pytest.mark.skipif(asan.libasan_path() is None, reason="the host compiler has no libasan.so")
def test_padded_rows_read_no_kv_page_under_address_sanitizer():
    """The padded rows' block tables hold page ids ~2^30 pages outside the pool: a kernel that
    read one K or V row for them would fault (AddressSanitizer reports it, in a child process).
    So a padded row costs its CTAs' q, out and workspace bytes, never KV bytes."""
    small = problem(seed=12, seq_lens=(40, 3), num_q_heads=4, num_kv_heads=2, head_dim=64)
    padded = _padded(small, 2, bucket=4)
    for splitk in ("4", "off"):
        attn = decoder(padded, backend=CpuBackend(asan=True), splitk=splitk)
        out, lse = run_poisoned(attn, padded)
        check_against_reference(padded, out, lse)


# -- tensor parallelism ------------------------------------------------------------------


def _shard(p: Problem, ranks: int, rank: int) -> Problem:
    """Rank ``rank`` of ``ranks``-way tensor parallelism: its contiguous share of q heads and
    the KV heads they read (NHD)."""
    h, kv = p.q.shape[1], p.k_cache.shape[2]
    qs, ks = slice(rank * h // ranks, (rank + 1) * h // ranks), slice(rank * kv // ranks, (rank + 1) * kv // ranks)
    return Problem(np.ascontiguousarray(p.q[:, qs]), np.ascontiguousarray(p.k_cache[:, :, ks]),
                             np.ascontiguousarray(p.v_cache[:, :, ks]), p.block_tables, p.seq_lens, p.k_scale,
                             p.v_scale, p.kv_layout)


TP = problem(seed=13, seq_lens=(3000, 1777), num_q_heads=48, num_kv_heads=4, head_dim=64, kv_dtype="fp8")


def _tp_run(ranks: int, splitk: str, **options):
    """Head outputs and lse of every rank, concatenated in head order, and the ranks' split count."""
    outs, lses, splits = [], [], set()
    for rank in range(ranks):
        shard = _shard(TP, ranks, rank)
        attn = decoder(shard, splitk=splitk, **options)
        splits.add(attn.plan(1).num_splits)
        out, lse = run_poisoned(attn, shard)
        check_against_reference(shard, out, lse)
        outs.append(out)
        lses.append(lse)
    return np.concatenate(outs, axis=1), np.concatenate(lses, axis=1), splits.pop()


def test_under_auto_the_split_count_and_so_a_heads_byte_promise_change_with_the_tensor_parallel_degree():
    """auto = ceil(2 x 132 SMs / q heads per rank): 6 splits at 48 heads (TP 1), 11 at 24 (TP 2),
    so a head's 3000 tokens are summed in 500-token splits at TP 1 and in 273-token ones at TP 2:
    both within the bar (``_tp_run`` checks each rank), but the same bytes are not promised
    (they are only for one split count: pin it, as the next test does); a split count moves
    some lse's last bit."""
    out_one, lse_one, splits_one = _tp_run(1, "auto")
    out_two, lse_two, splits_two = _tp_run(2, "auto")
    assert (splits_one, splits_two) == (6, 11)
    _, lse_off, _ = _tp_run(1, "off")
    assert (lse_off != lse_one).any()


def test_a_pinned_split_count_keeps_every_heads_bytes_across_tensor_parallel_degrees_and_heads_per_cta():
    one, lse_one, _ = _tp_run(1, "4", heads_per_cta=4)
    for ranks, hpc in ((2, 2), (4, 1)):
        sharded, lse, splits = _tp_run(ranks, "4", heads_per_cta=hpc)
        assert splits == 4 and sharded.tobytes() == one.tobytes() and lse.tobytes() == lse_one.tobytes()


def test_a_rank_builds_its_object_for_its_share_of_heads():
    attn = DecodeAttention(16 // 4, 4 // 4, 64, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=8, backend="cpu",
                           splitk="4")
    assert attn.shape.num_q_heads == 4 and attn.plan(8).num_splits == 4
