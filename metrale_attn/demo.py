"""``metrale-attn demo``: a realistic mixed decode batch, checked against the reference.

The 24/4/256 shape (or one rank of ``--model``'s) with an fp8 e4m3 KV cache (bf16 queries), page size 16, six
sequences of different lengths that share a prefix page, on the best backend
present: CuPy on a GPU, else the CPU backend (whose time is the simulator's, not a
kernel's). An MLA model's layer (576/512) reads its values as the first 512 dims of the
latent cache, a view of the uploaded keys, as a serving engine passes them.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from . import tolerance
from .attention import DecodeAttention
from .backends import get_backend
from .problems import make_problem

SHAPE = dict(num_q_heads=24, num_kv_heads=4, head_dim=256)
PAGE_SIZE = 16
SEQ_LENS = (1, 16, 17, 300, 777, 1500)


def run_demo(backend: Optional[str] = None, target: Optional[str] = None, seed: int = 0, layer=None) -> int:
    """Run, check, print; returns 0 when every element is within the 1-ulp bar. ``layer``: a
    ``precompile.Layer`` whose heads and head dim to run (its features are not read; None: 24/4/256)."""
    be = get_backend(backend)
    shape = SHAPE if layer is None else dict(num_q_heads=layer.num_q_heads, num_kv_heads=layer.num_kv_heads,
                                             head_dim=layer.head_dim)
    v_head_dim = shape["head_dim"] if layer is None or layer.v_head_dim is None else layer.v_head_dim
    problem = make_problem(
        np.random.default_rng(seed), num_seqs=len(SEQ_LENS), page_size=PAGE_SIZE, seq_lens=list(SEQ_LENS),
        kv_dtype="fp8", q_dtype="bf16", layout="NHD", share_prefix_pages=1, **shape,
    )
    if v_head_dim != shape["head_dim"]:  # MLA: V is the latent cache's first v_head_dim dims
        problem = dataclasses.replace(problem, v_cache=problem.k_cache[..., :v_head_dim], v_scale=problem.k_scale)
    attn = DecodeAttention(**shape, page_size=PAGE_SIZE, q_dtype="bfloat16", kv_dtype="fp8_e4m3",
                           max_batch=64, target=target, backend=be, v_head_dim=v_head_dim)
    plan = attn.plan(len(SEQ_LENS))
    print(attn.target_line())
    print(f"backend: {be.name}; batch {len(SEQ_LENS)} seqs, lengths {list(SEQ_LENS)}, page size {PAGE_SIZE}, "
          f"KV fp8 e4m3 (k_scale {problem.k_scale:.4g}, v_scale {problem.v_scale:.4g}), one shared prefix page")
    print(f"plan: impl={plan.impl} arm={plan.arm} splits={plan.num_splits} heads/CTA={plan.heads_per_cta} work items="
          f"{' + '.join(str(g.grid) for g in plan.launches)} CTAs={plan.ctas} ({plan.reason})")

    args = _to_backend(be, problem, v_head_dim if v_head_dim != shape["head_dim"] else None)
    out = be.empty((*args[0].shape[:-1], v_head_dim), args[0].dtype)
    start = time.perf_counter()
    out, lse = attn.run(*args, k_scale=problem.k_scale, v_scale=problem.v_scale, out=out, return_lse=True)
    be.synchronize()
    elapsed = time.perf_counter() - start

    ref_out, ref_lse = problem.reference(return_lse=True)
    got = np.asarray(be.host_copy(out))
    ulps = tolerance.ulp_distance(got, tolerance.round_to(ref_out, got.dtype))
    ok = tolerance.close_to_reference_mask(got, ref_out, v_absmax=problem.v_absmax())
    lse_err = float(np.max(np.abs(np.asarray(be.host_copy(lse)) - ref_lse)))
    kind = "CPU-backend time (a simulator, not kernel performance)" if be.emulated else "GPU kernel time"
    print(f"worst error: {int(ulps.max())} ulp (bf16) over {got.size} outputs; lse max abs error {lse_err:.2e}")
    print(f"{kind}: {elapsed * 1e3:.1f} ms, first call")
    print("PASS: within 1 ulp of the float64 reference" if ok.all() else f"FAIL: {int((~ok).sum())} outputs off")
    return 0 if ok.all() else 1


def _to_backend(be, problem, v_in_k: Optional[int]):
    """The problem's arrays on ``be``; ``v_in_k``: V is a view of the uploaded keys' first ``v_in_k`` dims."""
    arrays = (problem.q, problem.k_cache, problem.v_cache, problem.block_tables, problem.seq_lens)
    # CuPy has no fp8 dtype: the cache travels as its uint8 bits, which run() accepts on every backend.
    up = [be.upload(a.view(np.uint8) if a.dtype.itemsize == 1 else a) for a in arrays]
    if v_in_k is not None:
        up[2] = up[1][..., :v_in_k]
    return tuple(up)
