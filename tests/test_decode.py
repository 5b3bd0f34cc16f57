"""Every arm, dtype, head dim and layout, byte-compared with the float64 reference, on the CPU
backend and, through the ``backend`` fixture, on a CUDA device (``-m gpu``; there the grid
takes every page size, the CPU's takes them in turn)."""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metrale_attn import reference
from metrale_attn.config import IMPLS
from metrale_attn.policy import PD_MIN_KV_PER_SPLIT

from support.backends import on_backends
from support.problems import ARM_OPTIONS, check_against_reference, decoder, problem, run_poisoned

KV_DTYPES = ("bf16", "fp16", "fp8")
Q_DTYPES = ("bf16", "fp16")
LAYOUTS = ("NHD", "HND")
PAGE_SIZES = (1, 16, 7)


def _grid(impls=IMPLS):
    """The CPU backend's cases: every combination once, the page sizes taken in turn."""
    cases = []
    for impl in impls:
        for arm in ARM_OPTIONS:
            head_dims = (256,) if arm == "gqa_packed" else (64, 128, 256)
            for i, (kv, q, d, layout) in enumerate(itertools.product(KV_DTYPES, Q_DTYPES, head_dims, LAYOUTS)):
                cases.append(pytest.param(impl, arm, kv, q, d, layout, PAGE_SIZES[i % 3],
                                          id=f"{impl}-{arm}-kv{kv}-q{q}-hd{d}-{layout}"))
    return cases


def _device_grid():
    """The device's cases: every combination at every page size (the simt kernels at 16), fp8
    e5m2 caches on mma, and head dim 512 on simt (its alone)."""
    for impl in IMPLS:
        for arm in ARM_OPTIONS:
            kvs = KV_DTYPES + (("fp8_e5m2",) if impl == "mma" else ())
            head_dims = (256,) if arm == "gqa_packed" else (64, 128, 256) + ((512,) if impl == "simt" else ())
            for kv, q, d, layout in itertools.product(kvs, Q_DTYPES, head_dims, LAYOUTS):
                for page_size in PAGE_SIZES if impl == "mma" else (16,):
                    yield pytest.param(impl, arm, kv, q, d, layout, page_size,
                                       id=f"{impl}-{arm}-kv{kv}-q{q}-hd{d}-{layout}-p{page_size}")


def _heads(arm):
    return dict(num_q_heads=6, num_kv_heads=1) if arm == "gqa_packed" else dict(num_q_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("backend, impl, arm, kv, q, head_dim, layout, page_size", on_backends(_grid(), _device_grid()))
def test_every_arm_dtype_head_dim_and_layout_is_within_one_ulp_of_the_reference(backend, impl, arm, kv, q, head_dim,
                                                                                 layout, page_size):
    seq_lens = (0, 1, 2 * page_size + 1, 300)
    p = problem(seed=head_dim + page_size, head_dim=head_dim, page_size=page_size, seq_lens=seq_lens, kv_dtype=kv,
                q_dtype=q, layout=layout, share_prefix_pages=1, **_heads(arm))
    attn = decoder(p, backend=backend, impl=impl, **ARM_OPTIONS[arm])
    assert (attn.plan(len(seq_lens)).arm, attn.plan(len(seq_lens)).impl) == (arm, impl)
    out, lse = run_poisoned(attn, p)
    check_against_reference(p, out, lse)


EDGE_LENGTHS = {
    1: (1, 2, 3, 255, 256, 257),
    16: (15, 16, 17, 32, 33, 511, 512, 513),
    7: (6, 7, 8, 21, 1000, 3001),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
@pytest.mark.parametrize("page_size", sorted(EDGE_LENGTHS))
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_edge_lengths_at_page_and_split_boundaries_match_the_reference(backend, impl, arm, page_size, kv):
    head_dim = 256 if arm == "gqa_packed" else 128
    p = problem(seed=page_size, head_dim=head_dim, page_size=page_size, seq_lens=EDGE_LENGTHS[page_size],
                kv_dtype=kv, **_heads(arm))
    out, lse = run_poisoned(decoder(p, backend=backend, impl=impl, **ARM_OPTIONS[arm]), p)
    check_against_reference(p, out, lse)


def test_more_splits_than_pages_leaves_empty_splits_that_merge_without_nan(backend):
    p = problem(page_size=16, seq_lens=(1, 5, 40), head_dim=128)
    attn = decoder(p, backend=backend, splitk="16")
    assert attn.plan(3).num_splits == 16
    out, lse = run_poisoned(attn, p)
    check_against_reference(p, out, lse)


def test_a_sequence_of_thousands_of_pages_matches_the_reference(backend):
    p = problem(page_size=1, seq_lens=(4099,), head_dim=64, kv_dtype="fp8")
    for impl in IMPLS:
        for arm in ("unpacked", "splitk"):
            out, lse = run_poisoned(decoder(p, backend=backend, impl=impl, **ARM_OPTIONS[arm]), p)
            check_against_reference(p, out, lse)


def test_the_split_k_workspace_holds_the_reference_partials():
    p = problem(page_size=16, seq_lens=(0, 3, 700, 1500), head_dim=128, kv_dtype="fp8", num_q_heads=4, num_kv_heads=1)
    attn = decoder(p, splitk="5")
    run_poisoned(attn, p)
    n, h, d = p.q.shape
    ws = attn.workspace[: n * h * 5 * (d + 2)].reshape(n, h, 5, d + 2).astype(np.float64)
    ref = reference.splitk_partials(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 5, kv_layout=p.kv_layout,
                                    k_scale=p.k_scale, v_scale=p.v_scale)
    empty = ref[..., -1] == 0
    assert np.all(np.isneginf(ws[..., -2][empty])) and np.all(ws[..., -1][empty] == 0)
    assert np.all(ws[..., :-2][empty] == 0)
    np.testing.assert_allclose(ws[~empty], ref[~empty], rtol=1e-5, atol=1e-5)
    lengths = [b - a for a, b in reference.split_bounds(700, 5)]
    assert lengths == [PD_MIN_KV_PER_SPLIT, PD_MIN_KV_PER_SPLIT, 700 - 2 * PD_MIN_KV_PER_SPLIT, 0, 0]


def test_sm_scale_and_kv_scales_are_applied(backend):
    p = problem(page_size=16, seq_lens=(50, 300), head_dim=64, kv_dtype="fp16", k_scale=0.5, v_scale=3.0)
    out, lse = run_poisoned(decoder(p, backend=backend, sm_scale=0.3, splitk="3"), p)
    check_against_reference(p, out, lse, sm_scale=0.3)


def test_views_of_a_combined_kv_tensor_work_through_strides():
    p = problem(page_size=16, seq_lens=(20, 90), head_dim=128, layout="HND")
    kv = np.stack([p.k_cache, p.v_cache], axis=1)  # [pages, 2, kv_heads, page, D]
    k, v = kv[:, 0], kv[:, 1]
    assert not k.flags.c_contiguous
    attn = decoder(p, splitk="2")
    out, lse = attn.run(p.q, k, v, p.block_tables, p.seq_lens, return_lse=True)
    check_against_reference(p, out, lse)


def test_a_q_view_with_padded_heads_works_through_strides():
    p = problem(page_size=16, seq_lens=(20, 90), head_dim=64)
    padded = np.zeros((2, 6, 64), dtype=p.q.dtype)
    padded[:, :4] = p.q
    out, lse = decoder(p).run(padded[:, :4], p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True)
    check_against_reference(p, out, lse)


def test_fp8_caches_given_as_uint8_bits_give_the_same_bytes():
    p = problem(page_size=16, seq_lens=(77,), head_dim=64, kv_dtype="fp8")
    attn = decoder(p)
    a = attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale, v_scale=p.v_scale)
    b = attn.run(p.q, p.k_cache.view(np.uint8), p.v_cache.view(np.uint8), p.block_tables, p.seq_lens,
                 k_scale=p.k_scale, v_scale=p.v_scale)
    assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
def test_an_empty_batch_launches_nothing_and_returns_empty_outputs(arm, counting_backend):
    p = problem(seq_lens=(5,), head_dim=256 if arm == "gqa_packed" else 64, **_heads(arm))
    attn = decoder(p, backend=counting_backend, **ARM_OPTIONS[arm])
    out, lse = attn.run(p.q[:0], p.k_cache, p.v_cache, p.block_tables[:0], p.seq_lens[:0], return_lse=True)
    assert out.shape == (0,) + p.q.shape[1:] and lse.shape == (0, p.q.shape[1])
    assert counting_backend.launches == []


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
def test_every_arm_runs_clean_under_address_sanitizer(impl, arm):
    from metrale_attn.backends.cpu_backend import CpuBackend

    head_dim = 256 if arm == "gqa_packed" else 128
    p = problem(seed=9, page_size=7, seq_lens=(0, 1, 300), head_dim=head_dim, kv_dtype="fp8", layout="HND",
                **_heads(arm))
    out, lse = run_poisoned(decoder(p, backend=CpuBackend(asan=True), impl=impl, **ARM_OPTIONS[arm]), p)
    check_against_reference(p, out, lse)


@settings(max_examples=int(os.environ.get("METRALE_FUZZ_EXAMPLES", 60)), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(
    impl=st.sampled_from(IMPLS),
    arm=st.sampled_from(list(ARM_OPTIONS)),
    kv=st.sampled_from(KV_DTYPES),
    q=st.sampled_from(Q_DTYPES),
    layout=st.sampled_from(LAYOUTS),
    page_size=st.sampled_from([1, 2, 3, 5, 16, 31, 64, 256]),
    splits=st.integers(2, 16),
    lengths=st.lists(st.integers(0, 1200), min_size=1, max_size=5),
    seed=st.integers(0, 2**16),
)
def test_random_problems_on_every_arm_match_the_reference(impl, arm, kv, q, layout, page_size, splits, lengths, seed):
    head_dim = 256 if arm == "gqa_packed" else (64, 128, 256)[seed % 3]
    p = problem(seed=seed, head_dim=head_dim, page_size=page_size, seq_lens=tuple(lengths), kv_dtype=kv, q_dtype=q,
                layout=layout, share_prefix_pages=seed % 2, **_heads(arm))
    options = dict(ARM_OPTIONS[arm], splitk=str(splits)) if arm == "splitk" else ARM_OPTIONS[arm]
    out, lse = run_poisoned(decoder(p, impl=impl, **options), p)
    check_against_reference(p, out, lse)


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 7, 16, 64, 256])
@pytest.mark.parametrize("impl, arm, kv, q, head_dim, layout, _", _grid())
def test_the_full_sweep_of_page_sizes_and_lengths_matches_the_reference(impl, arm, kv, q, head_dim, layout, _,
                                                                        page_size):
    lengths = (0, 1, page_size - 1 or 1, page_size, page_size + 1, 2 * PD_MIN_KV_PER_SPLIT + 1, 2500)
    p = problem(seed=page_size, head_dim=head_dim, page_size=page_size, seq_lens=lengths, kv_dtype=kv, q_dtype=q,
                layout=layout, share_prefix_pages=1, **_heads(arm))
    out, lse = run_poisoned(decoder(p, impl=impl, **ARM_OPTIONS[arm]), p)
    check_against_reference(p, out, lse)
