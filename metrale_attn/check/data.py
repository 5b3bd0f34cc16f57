"""The tensors a timed configuration runs on, and its output checked against float64 on the device.

``GpuPool`` is a paged K/V pool on the device and ``Case`` one configuration drawn from it (q,
pools, page table and lengths), which ours and every peer take; ``check_gpu_output`` judges an
output ``[B, H, D]`` against a float64 decode of a few of its sequences computed on the device
(``reference_on_gpu``). ``metrale-attn check``, and the benchmark harness beside the library
(its sweep, L2 probe and PDL check), build their data here. PyTorch is imported when a pool is
built or an output checked, not at import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np

from .. import reference, tolerance

if TYPE_CHECKING:  # an annotation only
    from ..config import ModelShape

FP8_MAX = 448.0
FP8_SCALE = 6.0 / FP8_MAX
"""Per-tensor fp8 scale of the benchmark's caches: values ~ N(0, 1) stored as x / scale,
so |x| up to 6 (more than 6 sigma) spans the e4m3 range."""


@dataclass
class Case:
    """One configuration's data (PyTorch tensors on one device).

    ``q``: ``[B, H, D]`` bf16. ``k_pool``/``v_pool``: NHD ``[num_pages, page_size, KV, D]`` and
    ``[..., Dv]``, bf16 or ``torch.float8_e4m3fn`` (dequantized value = stored * scale); ``v_pool``
    is ``k_pool[..., :Dv]`` (a view: one cache) where the layer's V is K's first dims (MLA). The
    output is ``[B, H, Dv]``.
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
    def v_head_dim(self) -> int:
        return int(self.v_pool.shape[-1])

    @property
    def pages_per_seq(self) -> int:
        return -(-self.context // self.page_size)


class GpuPool:
    """A paged K/V pool on the GPU: NHD ``[num_pages, page_size, KV, D]`` for K and ``[..., Dv]``
    for V, shared by every shape with these KV heads and head dims (q heads only shape the query).
    ``v_in_k``: V is K's first ``Dv`` dims, a view of the one K pool (MLA's latent cache), not a
    pool of its own.

    Values ~ N(0, 1) (fp8: stored as x / FP8_SCALE, clamped to the e4m3 range), filled
    in chunks so that fp8 needs no full-size temporary.
    """

    CHUNK_BYTES = 1 << 30

    def __init__(self, shape: ModelShape, kv_dtype: str, page_size: int, num_pages: int, seed: int,
                 device: str = "cuda", v_in_k: bool = False):
        import torch

        self.torch, self.device = torch, device
        self.shape, self.kv_dtype, self.page_size, self.num_pages = shape, kv_dtype, page_size, num_pages
        self.scale = 1.0 if kv_dtype == "bf16" else FP8_SCALE
        dt = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.v_in_k = v_in_k
        dims = (page_size, shape.num_kv_heads, shape.head_dim)
        v_dims = (page_size, shape.num_kv_heads, shape.v_head_dim)
        self.k = torch.empty((num_pages, *dims), dtype=dt, device=device)
        self.v = self.k[..., :shape.v_head_dim] if v_in_k else torch.empty((num_pages, *v_dims), dtype=dt,
                                                                              device=device)
        for pool in (self.k,) if v_in_k else (self.k, self.v):
            chunk = max(1, self.CHUNK_BYTES // (math.prod(pool.shape[1:]) * 2))  # pages a bf16 temporary holds
            for start in range(0, num_pages, chunk):
                end = min(start + chunk, num_pages)
                x = torch.randn((end - start, *pool.shape[1:]), dtype=torch.bfloat16, device=device,
                                generator=self.gen)
                if kv_dtype == "fp8":
                    x = (x.float() / self.scale).clamp_(-FP8_MAX, FP8_MAX)
                pool[start:end] = x.to(dt)
        if device == "cuda":
            torch.cuda.synchronize()

    @property
    def nbytes(self) -> int:
        """Device bytes of the pool: K's, and V's where V is a pool of its own."""
        return (self.k.numel() + (0 if self.v_in_k else self.v.numel())) * self.k.element_size()

    def case(self, batch: int, context: int, num_q_heads: Optional[int] = None,
             sm_scale: Optional[float] = None) -> Case:
        """Tensors of one configuration: random q, pages drawn without replacement from the pool;
        ``sm_scale`` the layer's (None: ``1 / sqrt(head_dim)``, ``DecodeAttention``'s default)."""
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
                    sm_scale=1.0 / math.sqrt(s.head_dim) if sm_scale is None else sm_scale, kv_dtype=self.kv_dtype)


# -- the output against float64 ---------------------------------------------------------------

STRICT_BAR = "1 ulp or 2^-20 max|V| (tolerance.assert_close_to_reference)"


def check_seqs(batch: int, count: int) -> list[int]:
    """``count`` sequences spread over the batch, first and last included: ``(256, 2) -> [0, 255]``."""
    count = max(1, min(count, batch))
    if count == 1:
        return [0]
    return sorted({round(i * (batch - 1) / (count - 1)) for i in range(count)})


def gather_seq(case: Case, pool, seq: int, scale: float):
    """float64 ``[T, KV, D]``: one sequence's dequantized K or V, gathered on the device."""
    import torch

    pages = case.block_tables[seq, : case.pages_per_seq].long()
    if pool.dtype == torch.float8_e4m3fn:
        x = pool.view(torch.uint8)[pages].view(torch.float8_e4m3fn)
    else:
        x = pool[pages]
    x = x.reshape(-1, case.num_kv_heads, pool.shape[-1])[: int(case.seq_lens[seq])]
    return x.double() * scale


def reference_on_gpu(case: Case, seqs: list[int]):
    """float64 decode of ``seqs`` computed on the device: (``[len(seqs), H, Dv]`` numpy float64, max|V| read)."""
    import torch

    G = case.num_q_heads // case.num_kv_heads
    outs, v_absmax = [], 0.0
    for s in seqs:
        k = gather_seq(case, case.k_pool, s, case.k_scale)
        v = gather_seq(case, case.v_pool, s, case.v_scale)
        q = case.q[s].double().view(case.num_kv_heads, G, case.head_dim)
        logits = torch.einsum("kgd,tkd->kgt", q, k) * case.sm_scale
        p = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("kgt,tkd->kgd", p, v).reshape(case.num_q_heads, case.v_head_dim))
        v_absmax = max(v_absmax, float(v.abs().max()) if v.numel() else 0.0)
    return torch.stack(outs).cpu().numpy(), v_absmax


def to_numpy_bf16(t) -> np.ndarray:
    """A bf16 torch tensor as a NumPy ``ml_dtypes.bfloat16`` array on the host."""
    import ml_dtypes
    import torch

    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def check_gpu_output(case: Case, out, seqs: list[int], ref_cache: dict, *, strict: bool) -> dict:
    """NaN-free over the whole output ``[B, H, Dv]``, and ``seqs`` against the float64 reference (strict: the
    package's bar; loose, for peers: max abs error <= 1% of max|reference|). ``ref_cache`` keeps
    the reference of this case for the next output checked against it."""
    import torch

    nan_free = not bool(torch.isnan(out).any())
    if "ref" not in ref_cache:
        ref_cache["ref"] = reference_on_gpu(case, seqs)
    ref, v_absmax = ref_cache["ref"]
    got = to_numpy_bf16(out[seqs])
    check = {"seqs": seqs, "nan_free": nan_free}
    ulps = tolerance.ulp_distance(got, tolerance.round_to(ref, got.dtype))
    abs_err = float(np.nanmax(np.abs(got.astype(np.float64) - ref))) if got.size else 0.0
    check.update(max_ulp=int(ulps.max()) if ulps.size else 0, max_abs_err=abs_err)
    if strict:
        check["bar"] = STRICT_BAR
        try:
            tolerance.assert_close_to_reference(got, ref, v_absmax=v_absmax)
            check["status"] = "ok"
        except AssertionError as err:
            check.update(status="FAIL", message=str(err)[:600])
    else:
        tol = 0.01 * float(np.abs(ref).max()) if ref.size else 0.0
        check["bar"] = f"loose: max abs error <= 1% of max|ref| = {tol:.3g}"
        check["status"] = "ok" if abs_err <= tol else "FAIL"
    if not nan_free:
        check.update(status="FAIL", message=(check.get("message", "") + " NaN left in the output").strip())
    return check


def check_numpy(out: np.ndarray, ref: np.ndarray, v_absmax: float, seqs: list[int]) -> dict:
    """Host arrays ``out`` (bf16) and ``ref`` (float64), rows ``seqs``, at the package's bar; NaN-free."""
    nan_free = not bool(np.isnan(out.astype(np.float32)).any())
    check = {"seqs": seqs, "nan_free": nan_free, "bar": STRICT_BAR}
    try:
        tolerance.assert_close_to_reference(out[seqs], ref[seqs], v_absmax=v_absmax)
        ulps = tolerance.ulp_distance(out[seqs], tolerance.round_to(ref[seqs], out.dtype))
        check.update(status="ok" if nan_free else "FAIL", max_ulp=int(ulps.max()) if ulps.size else 0)
        if not nan_free:
            check["message"] = "NaN left in the output (an element was never written)"
    except AssertionError as err:
        check.update(status="FAIL", message=str(err)[:600])
    return check


def check_gpu_features(case: Case, q, out, seqs: list[int], features: dict) -> dict:
    """``seqs`` of an output computed with features (window, soft-cap, sinks, query tokens) against
    ``reference.paged_decode`` with them, in float64 on the host (each sequence's K/V gathered on
    the device), at the package's bar."""
    import torch

    nan_free = not bool(torch.isnan(out).any())
    refs, v_absmax = [], 0.0
    for s in seqs:
        k = gather_seq(case, case.k_pool, s, case.k_scale).cpu().numpy()[None]  # one page of every token
        v = gather_seq(case, case.v_pool, s, case.v_scale).cpu().numpy()[None]
        q_s = to_numpy_bf16(q[s:s + 1])
        refs.append(reference.paged_decode(q_s, k, v, np.zeros((1, 1), np.int32), np.array([k.shape[1]], np.int32),
                                           sm_scale=case.sm_scale, **features)[0])
        v_absmax = max(v_absmax, float(np.abs(v).max()) if v.size else 0.0)
    got = to_numpy_bf16(out[seqs])
    check = check_numpy(got, np.stack(refs), v_absmax, seqs=list(range(len(seqs))))
    check["seqs"] = seqs
    if not nan_free:
        check.update(status="FAIL", message=(check.get("message", "") + " NaN left in the output").strip())
    return check
