"""SGLang's token pool as FlashInfer's CSR page table: the arithmetic that turns a decode
batch's ``req_to_token`` rows into ``kv_indptr``/``kv_indices``/``kv_last_page_len`` for
``DecodeAttention(page_table="csr")`` at page size 1. Torch only, no SGLang import.

Request ``r`` of the batch owns row ``req_pool_indices[r]`` of ``req_to_token`` (int32
``[pool rows, max_context_len]``, slot ids); its first ``seq_lens[r]`` entries are its
tokens' slots, the current token's included. At page size 1 a slot is a page, so
``kv_indices`` is those entries, concatenated, and every last page holds one token (0
for an empty sequence, so its length reads as 0).
"""

from __future__ import annotations

from typing import Optional

import torch


def csr_capacity(max_bs: int, max_context_len: int) -> int:
    """Entries ``kv_indices`` needs for any batch of ``max_bs`` requests (what a CUDA-graph
    buffer is sized for; SGLang's Triton backend sizes its own the same way)."""
    return max_bs * max_context_len


def allocate_csr(max_bs: int, nnz: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zeroed int32 ``(kv_indptr [max_bs + 1], kv_indices [max(nnz, 1)], kv_last_page_len [max_bs])``."""
    return (torch.zeros(max_bs + 1, dtype=torch.int32, device=device),
            torch.zeros(max(nnz, 1), dtype=torch.int32, device=device),
            torch.zeros(max_bs, dtype=torch.int32, device=device))


def fill_csr(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int,
             kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_last_page_len: torch.Tensor, *,
             seq_lens_cpu: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Write the batch's CSR page table into the given int32 buffers (fixed addresses: a
    captured graph reads them again) and return the views a decode call takes:
    ``kv_indptr[:bs + 1]``, ``kv_indices`` whole (entries past ``num_tokens`` are stale and
    never read), ``kv_last_page_len[:bs]``. ``num_tokens``: ``seq_lens``' sum, known on the
    host (SGLang's ``seq_lens_sum``). ``seq_lens_cpu``: the host copy, where it exists, for
    the bounds checks; without it they read the device's (a sync). Nothing is written out
    of bounds: a batch that does not fit is refused, naming the argument."""
    bs = seq_lens.shape[0]
    for name, t in (("req_to_token", req_to_token), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                    ("kv_last_page_len", kv_last_page_len)):
        if t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous int32, got {t.dtype}")
    if req_to_token.dim() != 2:
        raise ValueError(f"req_to_token must be 2-D [pool rows, max_context_len], got {tuple(req_to_token.shape)}")
    if req_pool_indices.shape != (bs,):
        raise ValueError(f"req_pool_indices must be [{bs}] (one per request of seq_lens), "
                         f"got {tuple(req_pool_indices.shape)}")
    if kv_indptr.shape[0] < bs + 1 or kv_last_page_len.shape[0] < bs:
        raise ValueError(f"kv_indptr [{kv_indptr.shape[0]}] and kv_last_page_len [{kv_last_page_len.shape[0]}] "
                         f"hold fewer than {bs} requests")
    if not 0 <= num_tokens <= kv_indices.shape[0]:
        raise ValueError(f"num_tokens {num_tokens} does not fit kv_indices [{kv_indices.shape[0]}]")
    lens = seq_lens_cpu[:bs] if seq_lens_cpu is not None else seq_lens.cpu()
    rows = req_pool_indices.cpu() if req_pool_indices.device.type == "cpu" else None  # no sync on a GPU
    if bs:
        if int(lens.min()) < 0 or int(lens.max()) > req_to_token.shape[1]:
            raise ValueError(f"seq_lens must be within 0..{req_to_token.shape[1]} (req_to_token's columns), "
                             f"got {int(lens.min())}..{int(lens.max())}")
        if int(lens.sum()) != num_tokens:
            raise ValueError(f"num_tokens {num_tokens} is not the sum of seq_lens, {int(lens.sum())}")
        if rows is not None and (int(rows.min()) < 0 or int(rows.max()) >= req_to_token.shape[0]):
            raise ValueError(f"req_pool_indices must be within 0..{req_to_token.shape[0] - 1}, "
                             f"got {int(rows.min())}..{int(rows.max())}")
    indptr = kv_indptr[:bs + 1]
    indptr[0] = 0
    torch.cumsum(seq_lens, 0, dtype=torch.int32, out=indptr[1:])
    request = torch.repeat_interleave(torch.arange(bs, device=seq_lens.device), seq_lens.to(torch.int64),
                                      output_size=num_tokens)
    column = torch.arange(num_tokens, device=seq_lens.device) - indptr[request].to(torch.int64)
    kv_indices[:num_tokens] = req_to_token[req_pool_indices.to(torch.int64)[request], column]
    last = kv_last_page_len[:bs]
    last.copy_(seq_lens.clamp(max=1))
    return indptr, kv_indices, last
