"""Reliability, round 3, the launch side (issue 30): what a third adversarial review found in
the newest surfaces of ``run`` and construction (CSR lengths, multi-token decode under legacy
split-K, merge_states' alignment, soft-cap folds, torch tensors without strided storage, a
huge max batch). Each test pins one defect; every refusal comes before any launch and names
the argument and what was expected. Defect 1 (the launch cache) is ``test_launch_cache.py``'s."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from metrale_attn import DecodeAttention

from support.problems import CountingBackend

H, KV, D = 4, 2, 64


def test_a_csr_sequence_longer_than_an_int32_holds_is_refused_naming_its_length():
    """Defect 2: (pages - 1) * page_size + kv_last_page_len past 2**31 - 1 wrapped the kernels'
    int32 length (zeros and lse -inf, silently); the dense path's seq_lens cannot hold it."""
    backend = CountingBackend()
    attn = DecodeAttention(H, KV, D, 256, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend=backend,
                           page_table="csr")
    pages = 2**31 // 256 + 1  # (pages - 1) * 256 + 1 = 2**31 + 1 tokens
    q = np.zeros((1, H, D), ml_dtypes.bfloat16)
    cache = np.zeros((1, 256, KV, D), ml_dtypes.bfloat16)
    csr = dict(kv_indptr=np.array([0, pages], np.int32), kv_indices=np.zeros(pages, np.int32),
               kv_last_page_len=np.array([1], np.int32))
    with pytest.raises(ValueError, match=r"sequence 0's length .*kv_last_page_len\[0\] = 2147483649 is past "
                                         r"2147483647"):
        attn.run(q, cache, cache, **csr)
    assert not backend.launches
