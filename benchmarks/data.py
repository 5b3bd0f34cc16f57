"""The tensors a GPU configuration runs on: ``GpuPool``, a paged K/V pool on the device, and the
``Case`` drawn from it (one configuration's q, pools, page table and lengths), which ours and
every baseline take. The sweep on a GPU (``sweep.GpuSweep``) and the L2 probe's GPU target
(``l2_probe.py``) build their data here; PyTorch is imported when a pool is built, not at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # an annotation only: baselines, and FlashInfer's JIT processes, import no metrale_attn
    from metrale_attn.config import ModelShape

FP8_MAX = 448.0
FP8_SCALE = 6.0 / FP8_MAX
"""Per-tensor fp8 scale of the benchmark's caches: values ~ N(0, 1) stored as x / scale,
so |x| up to 6 (more than 6 sigma) spans the e4m3 range."""


@dataclass
class Case:
    """One configuration's data (PyTorch tensors on one device).

    ``q``: ``[B, H, D]`` bf16. ``k_pool``/``v_pool``: NHD ``[num_pages, page_size, KV, D]``,
    bf16 or ``torch.float8_e4m3fn`` (dequantized value = stored * scale).
    ``block_tables``: int32 ``[B, max_pages]``; ``seq_lens``: int32 ``[B]``, all equal to
    ``context`` here. ``sm_scale`` multiplies q.k before the softmax (natural exp).
    """

    q: object
    k_pool: object
    v_pool: object
    block_tables: object
    seq_lens: object
    context: int
    page_size: int
    num_kv_heads: int
    k_scale: float
    v_scale: float
    sm_scale: float
    kv_dtype: str  # "bf16" or "fp8"

    @property
    def batch(self) -> int:
        return int(self.q.shape[0])

    @property
    def num_q_heads(self) -> int:
        return int(self.q.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.q.shape[2])

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)


class GpuPool:
    """A paged K/V pool on the GPU: NHD ``[num_pages, page_size, KV, D]``, shared by every shape
    with these KV heads and head dim (q heads only shape the query).

    Values ~ N(0, 1) (fp8: stored as x / FP8_SCALE, clamped to the e4m3 range), filled
    in chunks so that fp8 needs no full-size temporary.
    """

    CHUNK_BYTES = 1 << 30

    def __init__(self, shape: ModelShape, kv_dtype: str, page_size: int, num_pages: int, seed: int,
                 device: str = "cuda"):
        import torch

        self.torch, self.device = torch, device
        self.shape, self.kv_dtype, self.page_size, self.num_pages = shape, kv_dtype, page_size, num_pages
        self.scale = 1.0 if kv_dtype == "bf16" else FP8_SCALE
        dt = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        dims = (page_size, shape.num_kv_heads, shape.head_dim)
        self.k = torch.empty((num_pages, *dims), dtype=dt, device=device)
        self.v = torch.empty((num_pages, *dims), dtype=dt, device=device)
        per_page = math.prod(dims) * 2  # bf16 temporary
        chunk = max(1, self.CHUNK_BYTES // per_page)
        for pool in (self.k, self.v):
            for start in range(0, num_pages, chunk):
                end = min(start + chunk, num_pages)
                x = torch.randn((end - start, *dims), dtype=torch.bfloat16, device=device, generator=self.gen)
                if kv_dtype == "fp8":
                    x = (x.float() / self.scale).clamp_(-FP8_MAX, FP8_MAX)
                pool[start:end] = x.to(dt)
        if device == "cuda":
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def case(self, batch: int, context: int, num_q_heads: Optional[int] = None) -> Case:
        """Tensors of one configuration: random q, pages drawn without replacement from the pool."""
        torch, s = self.torch, self.shape
        heads = num_q_heads or s.num_q_heads
        pages = -(-context // self.page_size)
        if batch * pages > self.num_pages:
            raise ValueError(f"pool of {self.num_pages} pages is too small for {batch} x {pages}")
        table = torch.randperm(self.num_pages, device=self.device, generator=self.gen)[: batch * pages]
        q = torch.randn((batch, heads, s.head_dim), device=self.device, generator=self.gen).to(torch.bfloat16)
        return Case(q=q, k_pool=self.k, v_pool=self.v, block_tables=table.view(batch, pages).to(torch.int32),
                    seq_lens=torch.full((batch,), context, dtype=torch.int32, device=self.device), context=context,
                    page_size=self.page_size, num_kv_heads=s.num_kv_heads, k_scale=self.scale, v_scale=self.scale,
                    sm_scale=1.0 / math.sqrt(s.head_dim), kv_dtype=self.kv_dtype)
