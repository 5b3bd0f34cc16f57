"""FlashInfer's CSR page table (``page_table="csr"``: ``kv_indptr``, ``kv_indices``,
``kv_last_page_len``), read by the kernels as it is: the bytes of the dense table it stands for."""

from __future__ import annotations

import numpy as np
import pytest

from support.backends import BACKENDS
from support.problems import ARM_OPTIONS, decoder, problem, run_poisoned, to_csr


def _pair(p, backend="cpu", **options):
    """The dense run and the CSR run of one problem."""
    dense = run_poisoned(decoder(p, backend=backend, **options), p)
    indptr, indices, last = to_csr(p)
    attn = decoder(p, backend=backend, page_table="csr", **options)
    csr = run_poisoned(attn, p, kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last, csr=True)
    return dense, csr


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
@pytest.mark.parametrize("page_size, layout", [(16, "NHD"), (7, "HND"), (1, "NHD")])
def test_a_csr_page_table_gives_the_bytes_of_the_dense_table_it_stands_for(backend, arm, page_size, layout):
    heads = dict(num_q_heads=12, num_kv_heads=2, head_dim=256) if arm == "gqa_packed" else {}
    p = problem(seed=41, page_size=page_size, layout=layout, seq_lens=(0, 1, page_size, 37, 300), kv_dtype="fp8",
                share_prefix_pages=1, **heads)
    dense, csr = _pair(p, backend, **ARM_OPTIONS[arm])
    assert dense[0].tobytes() == csr[0].tobytes() and dense[1].tobytes() == csr[1].tobytes()


def test_csr_composes_with_the_window_multi_token_decode_and_split_k():
    p = problem(seed=42, seq_lens=(5, 290, 1100), num_q_heads=8, num_kv_heads=2)
    q = np.random.default_rng(42).standard_normal((3, 3, 8, 64)).astype(p.q.dtype)
    options = dict(window_left=100, max_q_len=3, splitk="3")
    dense = run_poisoned(decoder(p, **options), p, q=q)
    indptr, indices, last = to_csr(p)
    csr = run_poisoned(decoder(p, page_table="csr", **options), p, q=q, kv_indptr=indptr, kv_indices=indices,
                       kv_last_page_len=last, csr=True)
    assert dense[0].tobytes() == csr[0].tobytes() and dense[1].tobytes() == csr[1].tobytes()


def test_a_page_table_in_the_other_form_or_in_part_is_refused():
    p = problem(seed=43, seq_lens=(5, 40))
    indptr, indices, last = to_csr(p)
    dense, csr = decoder(p), decoder(p, page_table="csr")
    with pytest.raises(ValueError, match="need page_table='csr'"):
        dense.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, kv_indptr=indptr, kv_indices=indices,
                  kv_last_page_len=last)
    with pytest.raises(ValueError, match="built with page_table='csr'"):
        csr.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    with pytest.raises(ValueError, match="built with page_table='csr'"):
        csr.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices)
    with pytest.raises(ValueError, match=r"kv_indptr must be contiguous int32 \[3\]"):
        csr.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr[:-1], kv_indices=indices, kv_last_page_len=last)
    with pytest.raises(ValueError, match="kv_indices must be contiguous int32"):
        csr.run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices.astype(np.int64),
                kv_last_page_len=last)
    with pytest.raises(ValueError, match="page_table must be one of dense, csr"):
        decoder(p, page_table="coo")


@pytest.mark.parametrize("edit, match", [
    (lambda ip, ix, lp: ip.__setitem__(1, ip[2] + 1), "kv_indptr must start at >= 0, never decrease"),
    (lambda ip, ix, lp: ip.__setitem__(-1, len(ix) + 1), "end within kv_indices"),
    (lambda ip, ix, lp: lp.__setitem__(1, 17), r"kv_last_page_len\[1\] = 17 must be in 1..16"),
    (lambda ip, ix, lp: lp.__setitem__(1, 0), r"kv_last_page_len\[1\] = 0 must be in 1..16"),
    (lambda ip, ix, lp: ix.__setitem__(1, 10**6), r"kv_indices\[1\] \(sequence 1's page 0\) = 1000000 is not a page"),
])
def test_the_host_check_of_a_csr_table_names_the_entry_that_is_wrong(edit, match):
    """On the CPU backend (or with check_indices=True) the table's values are proved in range
    before anything launches, naming the CSR entry."""
    p = problem(seed=44, seq_lens=(5, 40))
    indptr, indices, last = to_csr(p)
    edit(indptr, indices, last)
    with pytest.raises(ValueError, match=match):
        decoder(p, page_table="csr").run(p.q, p.k_cache, p.v_cache, kv_indptr=indptr, kv_indices=indices,
                                         kv_last_page_len=last)
