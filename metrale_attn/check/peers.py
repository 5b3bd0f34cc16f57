"""The peers a user would otherwise pick for paged decode, on the same data as ours.

Each ``prepare_*`` function takes a ``data.Case`` (one configuration's tensors, already on the
device) and returns a zero-argument callable that computes the decode output
``[num_seqs, num_q_heads, v_head_dim]`` (bf16), or raises ``Unavailable`` with the reason it
cannot run here. The caller warms the callable up, checks its output, then captures and times
it exactly like ours (``timing.py``).

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` after gathering each
  sequence's pages into a contiguous ``[B, KV, T, D]`` tensor (fp8 dequantized to bf16 in the
  gather: ``stored * scale``). The gather is INCLUDED in the call: this is what a serving stack
  without a paged kernel pays every step. ``prepare_sdpa_nogather`` gathers once before timing
  (an upper bound for dense attention on the same bytes). A wide layer (head dim past 256, or V
  narrower than K: MLA, whose V view of K is gathered as a tensor of its own) folds each KV
  head's query group into SDPA's query axis (``sdpa_folds_group``).
- ``flashinfer``: ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` on the same NHD pool and
  page table (its CUDA-core decode kernel; the tensor-core path where the decode kernel has no
  instance for the group size, e.g. 6). FlashInfer compiles its kernels on first use (nvcc,
  minutes) unless its JIT cache is warm or installed.

Both run on the CPU with PyTorch too (except FlashInfer), which is how their wiring is tested.
"""

from __future__ import annotations

from typing import Callable, Optional

from .data import Case

FLASHINFER_DECODE_GROUP_SIZES = (1, 2, 3, 4, 8)
"""Group sizes FlashInfer's CUDA-core decode kernel is instantiated for (DISPATCH_GQA_GROUP_SIZE);
other group sizes go through its tensor-core (prefill) kernels."""

FLASHINFER_WORKSPACE_BYTES = 128 * 1024 * 1024  # the size FlashInfer's documentation recommends



class Unavailable(Exception):
    """This peer cannot run on this configuration or machine; the message says why."""


# -- PyTorch SDPA ----------------------------------------------------------------


def gather_dense(case: Case, pool):
    """``[B, KV, T, D]`` bf16 (D: the pool's last dim, Dv for V): each sequence's pages gathered in
    order, fp8 dequantized (x scale)."""
    import torch

    B, P, T, page = case.batch, case.pages_per_seq, case.context, case.page_size
    pages = case.block_tables[:, :P].long()
    if pool.dtype == torch.float8_e4m3fn:
        # Index the bytes (indexing fp8 tensors is not supported everywhere), then dequantize.
        scale = case.v_scale if pool is case.v_pool else case.k_scale
        raw = pool.view(torch.uint8)[pages].view(torch.float8_e4m3fn)
        dense = raw.to(torch.bfloat16) * scale
    else:
        dense = pool[pages]
    # [B, P, page, KV, D] -> [B, P * page, KV, D] -> first T tokens -> [B, KV, T, D] (a strided view).
    return dense.reshape(B, P * page, case.num_kv_heads, pool.shape[-1])[:, :T].transpose(1, 2)


def sdpa_folds_group(case: Case) -> bool:
    """Whether SDPA runs ``case`` with each KV head's query group as its query axis (``[B, KV, G, D]``
    against ``[B, KV, T, D]``) rather than ``enable_gqa``: for a layer past the 64..256 head dims
    of the decisive grid or with V narrower than K. The same arithmetic (one query token, no
    mask: a group's G rows are G independent queries of one KV head), without K and V repeated
    per query head where SDPA's backend would repeat them (MLA at 128 heads: 128 copies of a
    302 MB gather); the grid's shapes keep ``enable_gqa``, as the benchmarks measured them."""
    return case.head_dim > 256 or case.v_head_dim != case.head_dim


def _sdpa(case: Case, k, v):
    import torch
    import torch.nn.functional as F

    if sdpa_folds_group(case):
        B, H, KV = case.batch, case.num_q_heads, case.num_kv_heads
        q = case.q.view(B, KV, H // KV, case.head_dim)  # head h = kv * G + g, as the kernels group them
        out = F.scaled_dot_product_attention(q, k, v, scale=case.sm_scale)
        return out.reshape(B, H, case.v_head_dim).to(torch.bfloat16)
    q = case.q.unsqueeze(2)  # [B, H, 1, D]
    out = F.scaled_dot_product_attention(q, k, v, scale=case.sm_scale, enable_gqa=True)
    return out.squeeze(2).to(torch.bfloat16)


def prepare_sdpa_gather(case: Case) -> Callable[[], object]:
    """SDPA with the page gather (and fp8 dequantization) inside the timed call."""
    _require_sdpa_gqa()
    return lambda: _sdpa(case, gather_dense(case, case.k_pool), gather_dense(case, case.v_pool))


def prepare_sdpa_nogather(case: Case) -> Callable[[], object]:
    """SDPA over K/V gathered once, contiguous ``[B, KV, T, D]`` bf16: the gather excluded."""
    _require_sdpa_gqa()
    k = gather_dense(case, case.k_pool).contiguous()
    v = gather_dense(case, case.v_pool).contiguous()
    return lambda: _sdpa(case, k, v)


def _require_sdpa_gqa() -> None:
    import inspect

    import torch.nn.functional as F

    try:
        params = inspect.signature(F.scaled_dot_product_attention).parameters
    except (TypeError, ValueError):  # a builtin without a signature: assume the modern one
        return
    if "enable_gqa" not in params:
        raise Unavailable("this PyTorch's scaled_dot_product_attention has no enable_gqa (needs >= 2.5)")


def gathered_bytes(case_batch: int, context: int, num_kv_heads: int, head_dim: int,
                   v_head_dim: Optional[int] = None) -> int:
    """Bytes of the bf16 K and V the SDPA baselines gather: what they need on top of the pool."""
    v_dims = head_dim if v_head_dim is None else v_head_dim
    return case_batch * context * num_kv_heads * (head_dim + v_dims) * 2


# -- FlashInfer ------------------------------------------------------------------


def flashinfer_spec(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> str:
    """The name of the FlashInfer JIT module a shape needs (what the prewarm compiles)."""
    tc = (num_q_heads // num_kv_heads) not in FLASHINFER_DECODE_GROUP_SIZES
    return f"hd{head_dim}-kv{kv_dtype}-{'tensorcore' if tc else 'decode'}"


def prepare_flashinfer(case: Case, *, status: Optional[dict] = None) -> Callable[[], object]:
    """FlashInfer's batch decode on the same NHD pool (``status``: the prewarm's results, if any)."""
    import torch

    spec = flashinfer_spec(case.num_q_heads, case.num_kv_heads, case.head_dim, case.kv_dtype)
    if status is not None:
        entry = status.get("specs", {}).get(spec)
        if entry is None:
            raise Unavailable(status.get("import_error") or f"FlashInfer spec {spec} was not compiled ahead "
                                                            "of the run")
        if entry.get("status") != "ok":
            raise Unavailable(f"FlashInfer spec {spec}: JIT prewarm {entry.get('status')}: "
                              f"{entry.get('reason', '')}"[:400])
    try:
        import flashinfer
    except Exception as err:
        raise Unavailable(f"flashinfer does not import ({type(err).__name__}: {err})"[:400]) from None
    B, H, D, KV, page, P = (case.batch, case.num_q_heads, case.head_dim, case.num_kv_heads, case.page_size,
                            case.pages_per_seq)
    device = case.q.device
    use_tc = (H // KV) not in FLASHINFER_DECODE_GROUP_SIZES
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=use_tc)
    indptr = torch.arange(B + 1, dtype=torch.int32, device=device) * P
    indices = case.block_tables[:, :P].contiguous().view(-1)
    last_page_len = (case.seq_lens - (P - 1) * page).to(torch.int32)
    wrapper.plan(indptr, indices, last_page_len, H, KV, D, page, q_data_type=case.q.dtype,
                 kv_data_type=case.k_pool.dtype, sm_scale=case.sm_scale)
    scales = {} if case.kv_dtype == "bf16" else dict(k_scale=case.k_scale, v_scale=case.v_scale)
    kv = (case.k_pool, case.v_pool)
    return lambda: wrapper.run(case.q, kv, **scales)
