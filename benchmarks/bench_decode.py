"""Paged-decode benchmark sweep: ours (every arm) against the baselines, on one GPU, in one run.

This script owns the sweep: which configurations run, the data they run on, the
correctness check before timing, the bytes a call must move, and the rows of the
result. Timing lives in ``gpu_timing.py``, the baselines in ``baselines.py``, the
environment and the copy-bandwidth ceiling in ``gpu_env.py``, and the JSON /
markdown / plots / targets in ``bench_report.py``.

What one row means (GPU):

- Configuration: a model shape (q heads / kv heads / head dim), the KV dtype (bf16,
  or fp8 e4m3 with a per-tensor scale; q and out are bf16), page size, batch and
  context (every sequence the same length; pages drawn at random from a pool, so a
  sequence's pages are scattered). The pool is allocated once per (shape, dtype),
  the size of the largest configuration that passes ``--kv-cap-gb``; larger
  configurations are skipped and listed with the reason.
- Ours: ``DecodeAttention(..., backend="cupy")`` with each arm forced
  (``unpacked``: splitk off; ``splitk``: splitk auto; ``gqa_packed``: splitk off +
  gqa_pack on, where the shape fits; ``splitk:N``: pinned N splits) and the
  policy's default (flagged ``default`` on the forced arm with the same geometry,
  or timed on its own). Arrays are PyTorch CUDA tensors (fp8 as
  ``torch.float8_e4m3fn``); ``run`` is given ``out`` so it allocates nothing.
- Check before timing: ``out`` is filled with NaN, the captured graph is launched
  once, then (1) no element of the whole output is NaN, and (2) the first and last
  sequences (``--check-seqs``) meet the package's correctness bar
  (``reference.assert_close_to_reference``: 1 ulp, or the near-zero absolute
  bound) against a float64 computation done on the GPU with PyTorch (the NumPy
  reference over the full batch would take minutes at these sizes). Baselines get
  the same float64 comparison with a loose bar (they round P to bf16): max abs
  error <= 1% of max|reference|.
- Time: median microseconds of a CUDA-graph launch between CUDA events on one
  stream, L2 flushed before each (``gpu_timing.py``).
- Bytes: what the call must move: KV actually touched (tokens x kv_heads x head_dim
  x itemsize x 2 for K and V) + q + out. ``tb_per_s`` = bytes / median time, in
  decimal TB/s; ``pct_of_copy`` = that over the measured device-to-device copy
  bandwidth. Baselines are charged the same bytes (same problem), so their TB/s is
  comparable effective bandwidth, whatever extra traffic they make.
- Host overhead: microseconds of Python per ``run`` call (eager, no sync, many
  calls) and per graph launch, at batch 1, context 1k.

``--time-budget-s`` bounds the sweep: once spent, the remaining configurations are
listed as not measured and the outputs are written with what was measured (exit 0).
An error outside a single measurement, or SIGTERM, also writes what was measured, and
exits 1.

``--cpu`` runs a tiny sweep on the CPU backend (the CUDA-on-CPU simulator) with the
same outputs; its timings are the simulator's wall clock, NOT kernel performance.

Usage::

    python3 benchmarks/bench_decode.py --out-dir OUT [--env-json env.json] [--time-budget-s 150]
    python3 benchmarks/bench_decode.py --cpu --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import bench_report  # noqa: E402
import gpu_env  # noqa: E402
from gpu_timing import Timing, time_host  # noqa: E402

from metrale_attn import DecodeAttention, policy, reference  # noqa: E402
from metrale_attn.cli import MODELS  # noqa: E402
from metrale_attn.plan import ModelShape  # noqa: E402

GB = 1e9  # decimal
ITEMSIZE = {"bf16": 2, "fp8": 1}
Q_ITEMSIZE = 2  # q and out are bf16
FP8_MAX = 448.0
FP8_SCALE = 6.0 / FP8_MAX
"""Per-tensor fp8 scale of the benchmark's caches: values ~ N(0, 1) stored as x / scale,
so |x| up to 6 (more than 6 sigma) spans the e4m3 range."""

ARM_OPTIONS = {
    "unpacked": dict(splitk="off", gqa_pack=False),
    "splitk": dict(splitk="auto", gqa_pack=False),
    "gqa_packed": dict(splitk="off", gqa_pack=True),
}
DEFAULT_ARMS = ("unpacked", "splitk", "gqa_packed")
GPU_DEFAULTS = dict(models="qwen3.8-27b,llama-3-8b,llama-3-70b", kv_dtypes="bf16,fp8", batches="1,4,16,64,256",
                    contexts="1024,4096,16384,65536", page_size=16)
CPU_DEFAULTS = dict(models="6/1/256", kv_dtypes="bf16", batches="1,2", contexts="64,300", page_size=16)
"""The CPU smoke sweep: the smallest shape that reaches all three arms (the GQA pack
needs q_heads = 6 x kv_heads at head_dim 256)."""
BASELINE_NAMES = ("sdpa_gather", "sdpa_nogather", "flex_paged", "flashinfer")


@dataclass(frozen=True)
class Config:
    """One point of the sweep."""

    model: str
    shape: ModelShape
    kv_dtype: str
    batch: int
    context: int
    page_size: int

    @property
    def shape_label(self) -> str:
        s = self.shape
        return f"{s.num_q_heads}/{s.num_kv_heads}/{s.head_dim}"

    @property
    def kv_bytes(self) -> int:
        """K and V bytes a call must read: tokens x kv_heads x head_dim x itemsize x 2."""
        s = self.shape
        return self.batch * self.context * s.num_kv_heads * s.head_dim * ITEMSIZE[self.kv_dtype] * 2

    @property
    def bytes_moved(self) -> int:
        """KV read + q read + out written (block tables and lengths are negligible and not counted)."""
        s = self.shape
        return self.kv_bytes + 2 * self.batch * s.num_q_heads * s.head_dim * Q_ITEMSIZE

    def describe(self) -> dict:
        return dict(model=self.model, shape=self.shape_label, q_heads=self.shape.num_q_heads,
                    kv_heads=self.shape.num_kv_heads, head_dim=self.shape.head_dim, kv_dtype=self.kv_dtype,
                    q_dtype="bf16", page_size=self.page_size, batch=self.batch, context=self.context,
                    kv_bytes=self.kv_bytes, bytes=self.bytes_moved)


def parse_models(text: str) -> list[tuple[str, ModelShape]]:
    """``qwen3.8-27b,llama-3-8b`` or ``24/4/256`` spellings -> (label, shape)."""
    out = []
    for item in (t.strip() for t in text.split(",") if t.strip()):
        if item in MODELS:
            out.append((item, MODELS[item]))
        else:
            try:
                h, kv, d = (int(x) for x in item.split("/"))
            except ValueError:
                raise SystemExit(f"--models: {item!r} is neither one of {', '.join(MODELS)} nor q/kv/head_dim")
            out.append((item, ModelShape(h, kv, d)))
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def enumerate_configs(args) -> list[Config]:
    """Every configuration, in the order they run: KV dtype, then model, then batch, then context
    (so a sweep cut short by its time budget has covered every model in the first dtype)."""
    return [Config(model, shape, kv, b, ctx, args.page_size)
            for kv in args.kv_dtypes.split(",")
            for model, shape in parse_models(args.models)
            for b in _ints(args.batches)
            for ctx in _ints(args.contexts)]


def arms_for(shape: ModelShape, arms: list[str]) -> list[str]:
    """The forced arms that exist for ``shape`` (the GQA pack only where the shape fits)."""
    out = []
    for arm in arms:
        if arm == "gqa_packed" and not policy.gqa_pack_shape_ok(shape.num_q_heads, shape.num_kv_heads,
                                                               shape.head_dim):
            continue
        out.append(arm)
    return out


def arm_options(arm: str) -> dict:
    """DecodeAttention overrides that force ``arm`` (``splitk:N`` pins N splits)."""
    if arm.startswith("splitk:"):
        return dict(splitk=arm.split(":", 1)[1], gqa_pack=False)
    if arm == "default":
        return {}
    return ARM_OPTIONS[arm]


def make_row(config: Config, impl: str, *, timing: Optional[Timing], copy_tb_per_s: Optional[float], status: str,
             arm: Optional[str] = None, check: Optional[dict] = None, plan=None, default: bool = False,
             reason: str = "", extra: Optional[dict] = None) -> dict:
    """One result row: configuration, implementation, time, bytes, TB/s and % of copy bandwidth."""
    row = config.describe()
    row.update(impl=impl, arm=arm, default=default, status=status, reason=reason, check=check)
    if plan is not None:
        row.update(plan_arm=plan.arm, num_splits=plan.num_splits, ctas=plan.ctas,
                   grids=[list(g.grid) for g in plan.launches], plan_reason=plan.reason)
    if timing is not None:
        tb = config.bytes_moved / (timing.median_us * 1e-6) / 1e12
        row.update(median_us=timing.median_us, min_us=timing.min_us, max_us=timing.max_us, iters=timing.iters,
                   samples_us=[round(x, 2) for x in timing.samples_us],
                   timing_mode=timing.mode, timing_note=timing.note, tb_per_s=tb,
                   pct_of_copy=100.0 * tb / copy_tb_per_s if copy_tb_per_s else None)
    if extra:
        row.update(extra)
    return row


class Terminated(BaseException):
    """SIGTERM (``timeout`` at gpu_check.sh's cap): stop measuring, write what was measured.

    A BaseException, so that the per-configuration ``except Exception`` handlers let it through."""


def _on_sigterm(signum, frame):
    raise Terminated(f"terminated by signal {signum} (the caller's time cap)")


def _short(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


# =====================================================================================
# CPU smoke sweep (the CUDA-on-CPU simulator)
# =====================================================================================


def run_cpu(args, result: dict) -> None:
    rows, t_start = result["rows"], time.monotonic()
    configs = enumerate_configs(args)
    arms = args.arms.split(",")
    max_batch = max(_ints(args.batches))
    attns: dict = {}
    for i, config in enumerate(configs):
        if time.monotonic() - t_start > args.time_budget_s:
            _not_measured(result, configs[i:], "time budget spent")
            break
        rng = np.random.default_rng(args.seed + i)
        s = config.shape
        p = reference.make_problem(rng, num_seqs=config.batch, num_q_heads=s.num_q_heads,
                                   num_kv_heads=s.num_kv_heads, head_dim=s.head_dim, page_size=config.page_size,
                                   seq_lens=config.context, kv_dtype=config.kv_dtype, q_dtype="bf16", layout="NHD")
        ref = p.reference()
        v_absmax = p.v_absmax()
        for arm in ["default"] + arms_for(s, arms):
            key = (config.model, config.kv_dtype, arm)
            if key not in attns:
                attns[key] = DecodeAttention(s.num_q_heads, s.num_kv_heads, s.head_dim, config.page_size,
                                             q_dtype="bf16", kv_dtype=config.kv_dtype, max_batch=max_batch,
                                             backend="cpu", **arm_options(arm))

        def measure(arm: str, is_default: bool) -> dict:
            attn = attns[(config.model, config.kv_dtype, arm)]
            out = np.full((config.batch, s.num_q_heads, s.head_dim), np.nan, dtype=p.q.dtype)
            call = lambda: attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale,
                                    v_scale=p.v_scale, out=out)
            call()
            check = _check_numpy(out, ref, v_absmax, seqs=list(range(config.batch)))
            timing = time_host(call, target_s=args.cpu_target_s)
            return make_row(config, "metrale", arm=arm, timing=timing, copy_tb_per_s=result["copy_tb_per_s"],
                            status="ok" if check["status"] == "ok" else "wrong", check=check,
                            plan=attn.plan(config.batch), default=is_default)

        default_plan = attns[(config.model, config.kv_dtype, "default")].plan(config.batch)
        matched = False
        for arm in arms_for(s, arms):
            plan = attns[(config.model, config.kv_dtype, arm)].plan(config.batch)
            is_default = not matched and (plan.arm, plan.num_splits) == (default_plan.arm, default_plan.num_splits)
            matched |= is_default
            rows.append(measure(arm, is_default))
        if not matched:  # the policy's geometry is none of the forced arms': time it as its own row
            rows.append(measure("default", True))
    for name in _baseline_list(args):
        result["baselines"][name] = {"status": "not run", "reason": "CPU backend smoke run: no baselines"}


def check_seq_indices(batch: int, count: int) -> list[int]:
    """``count`` sequences spread over the batch, first and last included: ``(256, 2) -> [0, 255]``."""
    count = max(1, min(count, batch))
    if count == 1:
        return [0]
    return sorted({round(i * (batch - 1) / (count - 1)) for i in range(count)})


def _check_numpy(out, ref, v_absmax: float, seqs: list[int]) -> dict:
    nan_free = not bool(np.isnan(out.astype(np.float32)).any())
    check = {"seqs": seqs, "nan_free": nan_free, "bar": "1 ulp or 2^-20 max|V| (reference.assert_close_to_reference)"}
    try:
        reference.assert_close_to_reference(out[seqs], ref[seqs], v_absmax=v_absmax)
        ulps = reference.ulp_distance(out[seqs], reference.round_to(ref[seqs], out.dtype))
        check.update(status="ok" if nan_free else "FAIL", max_ulp=int(ulps.max()) if ulps.size else 0)
        if not nan_free:
            check["message"] = "NaN left in the output (an element was never written)"
    except AssertionError as err:
        check.update(status="FAIL", message=str(err)[:600])
    return check


# =====================================================================================
# GPU sweep
# =====================================================================================


class GpuPool:
    """A paged K/V pool on the GPU for one (shape, dtype): NHD ``[num_pages, page_size, KV, D]``.

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

    def case(self, batch: int, context: int):
        """Tensors of one configuration: random q, pages drawn without replacement from the pool."""
        from baselines import Case

        torch, s = self.torch, self.shape
        pages = -(-context // self.page_size)
        if batch * pages > self.num_pages:
            raise ValueError(f"pool of {self.num_pages} pages is too small for {batch} x {pages}")
        table = torch.randperm(self.num_pages, device=self.device, generator=self.gen)[: batch * pages]
        q = torch.randn((batch, s.num_q_heads, s.head_dim), device=self.device, generator=self.gen).to(torch.bfloat16)
        return Case(q=q, k_pool=self.k, v_pool=self.v, block_tables=table.view(batch, pages).to(torch.int32),
                    seq_lens=torch.full((batch,), context, dtype=torch.int32, device=self.device), context=context,
                    page_size=self.page_size, num_kv_heads=s.num_kv_heads, k_scale=self.scale, v_scale=self.scale,
                    sm_scale=1.0 / math.sqrt(s.head_dim), kv_dtype=self.kv_dtype)


def _gather_seq(case, pool, seq: int, scale: float):
    """float64 ``[T, KV, D]``: one sequence's dequantized K or V, gathered on the GPU."""
    import torch

    pages = case.block_tables[seq, : case.pages_per_seq].long()
    if pool.dtype == torch.float8_e4m3fn:
        x = pool.view(torch.uint8)[pages].view(torch.float8_e4m3fn)
    else:
        x = pool[pages]
    x = x.reshape(-1, case.num_kv_heads, case.head_dim)[: int(case.seq_lens[seq])]
    return x.double() * scale


def reference_on_gpu(case, seqs: list[int]):
    """float64 decode of ``seqs`` computed on the GPU: (``[len(seqs), H, D]`` numpy float64, max|V| read)."""
    import torch

    G = case.num_q_heads // case.num_kv_heads
    outs, v_absmax = [], 0.0
    for s in seqs:
        k = _gather_seq(case, case.k_pool, s, case.k_scale)
        v = _gather_seq(case, case.v_pool, s, case.v_scale)
        q = case.q[s].double().view(case.num_kv_heads, G, case.head_dim)
        logits = torch.einsum("kgd,tkd->kgt", q, k) * case.sm_scale
        p = torch.softmax(logits, dim=-1)
        outs.append(torch.einsum("kgt,tkd->kgd", p, v).reshape(case.num_q_heads, case.head_dim))
        v_absmax = max(v_absmax, float(v.abs().max()) if v.numel() else 0.0)
    return torch.stack(outs).cpu().numpy(), v_absmax


def _to_numpy_bf16(t):
    import ml_dtypes
    import torch

    return t.detach().contiguous().view(torch.int16).cpu().numpy().view(ml_dtypes.bfloat16)


def check_gpu_output(case, out, seqs: list[int], ref_cache: dict, *, strict: bool) -> dict:
    """NaN-free over the whole output, and ``seqs`` against the float64 reference (strict: the
    package's bar; loose, for baselines: max abs error <= 1% of max|reference|)."""
    import torch

    nan_free = not bool(torch.isnan(out).any())
    if "ref" not in ref_cache:
        ref_cache["ref"] = reference_on_gpu(case, seqs)
    ref, v_absmax = ref_cache["ref"]
    got = _to_numpy_bf16(out[seqs])
    check = {"seqs": seqs, "nan_free": nan_free}
    ulps = reference.ulp_distance(got, reference.round_to(ref, got.dtype))
    abs_err = float(np.nanmax(np.abs(got.astype(np.float64) - ref))) if got.size else 0.0
    check.update(max_ulp=int(ulps.max()) if ulps.size else 0, max_abs_err=abs_err)
    if strict:
        check["bar"] = "1 ulp or 2^-20 max|V| (reference.assert_close_to_reference)"
        try:
            reference.assert_close_to_reference(got, ref, v_absmax=v_absmax)
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


class GpuSweep:
    """Runs the configurations of one process on the GPU and fills ``result``."""

    def __init__(self, args, result: dict):
        import cupy  # noqa: F401  (the backend; fail early with a clear error)
        import torch

        from gpu_timing import GpuTimer

        self.args, self.result, self.torch = args, result, torch
        self.timer = GpuTimer(flush_bytes=int(args.flush_mb * 1e6), target_ms=args.target_ms,
                              max_iters=args.max_iters)
        self.copy_tb = result["copy_tb_per_s"]
        self.baselines = _baseline_list(args)
        self.flex_spent_s = 0.0
        self.flex_compiles = 0
        self.flashinfer_status = None
        self.pending: list[Config] = []  # not measured yet (listed as such if the run is cut short)
        self.t_start = time.monotonic()

    # -- the sweep ------------------------------------------------------------

    def run(self) -> None:
        args, result = self.args, self.result
        configs = enumerate_configs(args)
        cap = args.kv_cap_gb * GB
        runnable = []
        for c in configs:
            if c.kv_bytes > cap:
                result["skipped"].append(dict(c.describe(), reason=f"KV {c.kv_bytes / GB:.3g} GB > cap "
                                                                   f"{args.kv_cap_gb:g} GB (--kv-cap-gb)"))
            else:
                runnable.append(c)
        if "flashinfer" in self.baselines:
            self._prepare_flashinfer(runnable)
        groups: dict = {}
        for c in runnable:
            groups.setdefault((c.model, c.kv_dtype), []).append(c)
        pending = self.pending = list(runnable)
        for (model, kv_dtype), group in groups.items():
            if self._over_budget():
                break
            try:
                self._run_group(group, pending)
            except Exception as err:  # a whole group failed (pool allocation, compile): record, go on
                traceback.print_exc()
                for c in group:
                    if c in pending:
                        pending.remove(c)
                        result["rows"].append(make_row(c, "metrale", timing=None, copy_tb_per_s=self.copy_tb,
                                                       status="failed", reason=f"group aborted: {_short(err)}"))
            gc.collect()
            self.torch.cuda.empty_cache()
        if pending:
            _not_measured(result, pending, f"time budget of {args.time_budget_s:g} s spent")

    def _over_budget(self) -> bool:
        return time.monotonic() - self.t_start > self.args.time_budget_s

    def _run_group(self, group: list[Config], pending: list[Config]) -> None:
        args, torch = self.args, self.torch
        first = group[0]
        shape, kv_dtype = first.shape, first.kv_dtype
        pages = max(c.batch * -(-c.context // c.page_size) for c in group)
        t0 = time.monotonic()
        pool = GpuPool(shape, kv_dtype, first.page_size, pages, seed=args.seed)
        max_batch = max(c.batch for c in group)
        attns = {}
        for arm in ["default"] + arms_for(shape, args.arms.split(",")):
            t1 = time.monotonic()
            attns[arm] = DecodeAttention(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, first.page_size,
                                         q_dtype="bf16", kv_dtype=kv_dtype, max_batch=max_batch, backend="cupy",
                                         **arm_options(arm))
            self.result["compile_s"][f"{first.model}/{kv_dtype}/{arm}"] = round(time.monotonic() - t1, 2)
        print(f"[{first.model} {kv_dtype}] pool {2 * pool.k.numel() * pool.k.element_size() / GB:.1f} GB, "
              f"set-up {time.monotonic() - t0:.1f} s; {attns['default'].target_line()}", flush=True)
        for config in group:
            if self._over_budget():
                return
            pending.remove(config)
            case = pool.case(config.batch, config.context)
            t1 = time.monotonic()
            self._run_config(config, case, attns)
            print(f"  b={config.batch:<4} ctx={config.context:<6} {time.monotonic() - t1:5.1f} s  "
                  f"{_brief(self.result['rows'], config)}", flush=True)
            del case
        del pool
        gc.collect()
        torch.cuda.empty_cache()

    def _run_config(self, config: Config, case, attns: dict) -> None:
        # The case was made on PyTorch's default stream; everything below runs on the timer's
        # (non-blocking) stream: wait for the inputs first.
        self.timer.synchronize_device()
        seqs = check_seq_indices(config.batch, self.args.check_seqs)
        ref_cache: dict = {}
        default_plan = attns["default"].plan(config.batch)
        matched = False
        for arm, attn in attns.items():
            if arm == "default":
                continue
            plan = attn.plan(config.batch)
            is_default = not matched and (plan.arm, plan.num_splits) == (default_plan.arm, default_plan.num_splits)
            matched |= is_default
            self.result["rows"].append(self._measure_ours(config, case, attn, arm, plan, is_default, seqs, ref_cache))
        if not matched:  # the policy chose a geometry no forced arm has: time it as its own row
            self.result["rows"].append(self._measure_ours(config, case, attns["default"], "default", default_plan,
                                                          True, seqs, ref_cache))
        if config.batch == 1 and config.context == min(_ints(self.args.contexts)) and self.args.host_overhead_iters:
            self._host_overhead(config, case, attns)
        for name in self.baselines:
            # Each baseline's tensors and graph are freed when it returns (PyTorch's cache reuses them).
            self.result["rows"].append(self._measure_baseline(config, case, name, seqs, ref_cache))
        gc.collect()
        self.torch.cuda.empty_cache()

    # -- ours -----------------------------------------------------------------

    def _ours_call(self, case, attn, out):
        return lambda: attn.run(case.q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens,
                                k_scale=case.k_scale, v_scale=case.v_scale, out=out)

    def _measure_ours(self, config, case, attn, arm, plan, is_default, seqs, ref_cache) -> dict:
        torch, timer = self.torch, self.timer
        try:
            out = torch.empty_like(case.q)
            call = self._ours_call(case, attn, out)
            timer.synchronize_device()
            with timer.on_stream():  # warm-up outside capture
                call()
                call()
            launch = timer.capture_cupy(call)
            out.fill_(float("nan"))
            timer.synchronize_device()
            with timer.on_stream():
                launch()
            timer.synchronize_device()
            check = check_gpu_output(case, out, seqs, ref_cache, strict=True)
            timing = timer.measure(launch)
            return make_row(config, "metrale", arm=arm, timing=timing, copy_tb_per_s=self.copy_tb,
                            status="ok" if check["status"] == "ok" else "wrong", check=check, plan=plan,
                            default=is_default)
        except Exception as err:
            traceback.print_exc()
            return make_row(config, "metrale", arm=arm, timing=None, copy_tb_per_s=self.copy_tb, status="failed",
                            reason=_short(err), plan=plan, default=is_default)

    def _host_overhead(self, config, case, attns) -> None:
        """Python microseconds per call: eager ``run`` (no sync) and a graph launch, per arm."""
        torch, timer, iters = self.torch, self.timer, self.args.host_overhead_iters
        for arm, attn in attns.items():
            try:
                out = torch.empty_like(case.q)
                call = self._ours_call(case, attn, out)
                eager = timer.host_overhead_us(call, iters=iters)
                launch = timer.capture_cupy(call)
                graph = timer.host_overhead_us(launch, iters=iters)
                gpu = timer.measure(launch)
                self.result["host_overhead"].append(dict(
                    model=config.model, kv_dtype=config.kv_dtype, batch=config.batch, context=config.context,
                    arm=arm, plan_arm=attn.plan(config.batch).arm, iters=iters, eager_run_us=eager,
                    graph_launch_us=graph, gpu_median_us=gpu.median_us))
            except Exception as err:
                self.result["host_overhead"].append(dict(model=config.model, kv_dtype=config.kv_dtype, arm=arm,
                                                         error=_short(err)))

    # -- baselines --------------------------------------------------------------

    def _measure_baseline(self, config, case, name, seqs, ref_cache) -> dict:
        import baselines
        from gpu_timing import try_capture_torch

        torch, timer, args = self.torch, self.timer, self.args
        row = lambda **kw: make_row(config, name, copy_tb_per_s=self.copy_tb, **kw)
        s = config.shape
        t0 = time.monotonic()
        try:
            if name.startswith("sdpa"):
                need = baselines.gathered_bytes(config.batch, config.context, s.num_kv_heads, s.head_dim)
                if need > args.gather_cap_gb * GB:
                    raise baselines.Unavailable(f"gathered bf16 K/V would take {need / GB:.1f} GB > "
                                                f"{args.gather_cap_gb:g} GB (--gather-cap-gb)")
                fn = baselines.BASELINES[name][1](case)
            elif name == "flex_paged":
                if config.batch not in _ints(args.flex_batches):
                    raise baselines.Unavailable(f"batch {config.batch} not in --flex-batches {args.flex_batches} "
                                                "(one torch.compile per shape and batch)")
                if self.flex_spent_s > args.flex_budget_s:
                    raise baselines.Unavailable(f"FlexAttention compile budget of {args.flex_budget_s:g} s spent "
                                                f"({self.flex_compiles} compiles)")
                fn = baselines.prepare_flex_paged(case)
            elif name == "flashinfer":
                fn = baselines.prepare_flashinfer(case, status=self.flashinfer_status)
            else:
                raise baselines.Unavailable(f"unknown baseline {name}")
            timer.synchronize_device()  # what prepare made on the default stream, before our stream reads it
            with timer.on_stream():
                out = fn()  # first call: compiles (flex), allocates
                fn()
            timer.synchronize_device()
            if name == "flex_paged":
                self.flex_spent_s += time.monotonic() - t0
                self.flex_compiles += 1
            check = check_gpu_output(case, out, seqs, ref_cache, strict=False)
            del out
            launch, mode, note, _ = try_capture_torch(timer, fn)
            timing = timer.measure(launch, mode=mode, note=note)
            return row(timing=timing, status="ok" if check["status"] == "ok" else "wrong", check=check,
                       extra=dict(setup_s=round(time.monotonic() - t0, 2)))
        except baselines.Unavailable as err:
            return row(timing=None, status="unavailable", reason=str(err))
        except Exception as err:
            if name == "flex_paged":
                self.flex_spent_s += time.monotonic() - t0
            traceback.print_exc()
            try:
                torch.cuda.synchronize()
            except Exception:
                pass
            return row(timing=None, status="failed", reason=_short(err))

    def _prepare_flashinfer(self, configs: list[Config]) -> None:
        import baselines

        args = self.args
        if args.flashinfer_status:  # compiled ahead (gpu_check.sh): never compile here, whatever it says
            try:
                with open(args.flashinfer_status) as f:
                    self.flashinfer_status = json.load(f)
            except (OSError, ValueError) as err:
                self.flashinfer_status = {"variants": {}, "import_error": f"prewarm status unreadable: {err}"}
            return
        shapes = sorted({(c.shape.num_q_heads, c.shape.num_kv_heads, c.shape.head_dim) for c in configs})
        dtypes = sorted({c.kv_dtype for c in configs})
        t0 = time.monotonic()
        self.flashinfer_status = baselines.flashinfer_prewarm(shapes, dtypes, timeout_s=args.flashinfer_jit_cap_s)
        self.flashinfer_status["elapsed_s"] = round(time.monotonic() - t0, 1)


def _brief(rows: list[dict], config: Config) -> str:
    """A one-line progress note: each implementation's TB/s for this configuration."""
    parts = []
    for r in rows:
        if (r["model"], r["kv_dtype"], r["batch"], r["context"]) != (config.model, config.kv_dtype, config.batch,
                                                                      config.context):
            continue
        label = r["arm"] if r["impl"] == "metrale" else r["impl"]
        parts.append(f"{label}={r['tb_per_s']:.2f}" if r.get("tb_per_s") else f"{label}:{r['status']}")
    return " ".join(parts)


def _not_measured(result: dict, configs: list[Config], reason: str) -> None:
    result["budget"]["stopped_early"] = True
    result["budget"]["reason"] = reason
    for c in configs:
        result["not_measured"].append(dict(c.describe(), reason=reason))


def _baseline_list(args) -> list[str]:
    if args.baselines in ("", "none"):
        return []
    names = [b.strip() for b in args.baselines.split(",") if b.strip()]
    unknown = [b for b in names if b not in BASELINE_NAMES]
    if unknown:
        raise SystemExit(f"--baselines: unknown {unknown}; choose from {', '.join(BASELINE_NAMES)}")
    return names


def summarize_baselines(result: dict) -> None:
    """Per baseline: ran on how many configurations, and why it did not on the others."""
    for name in _baseline_names_in(result):
        rows = [r for r in result["rows"] if r["impl"] == name]
        entry = result["baselines"].setdefault(name, {})
        ran = [r for r in rows if r.get("median_us") is not None]
        reasons: dict = {}
        for r in rows:
            if r.get("median_us") is None:
                reasons[r.get("reason") or r["status"]] = reasons.get(r.get("reason") or r["status"], 0) + 1
        entry.update(configs=len(rows), ran=len(ran), not_run_reasons=reasons,
                     status=entry.get("status") or ("ran" if ran else "did not run"))


def _baseline_names_in(result: dict) -> list[str]:
    seen = []
    for r in result["rows"]:
        if r["impl"] != "metrale" and r["impl"] not in seen:
            seen.append(r["impl"])
    for name in result["baselines"]:
        if name not in seen:
            seen.append(name)
    return seen


# =====================================================================================
# main
# =====================================================================================


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="tiny sweep on the CPU backend simulator (no GPU)")
    p.add_argument("--out-dir", default=".", help="where the JSON, markdown and plots go")
    p.add_argument("--stem", help="file name stem (default: DATE_DEVICE)")
    p.add_argument("--env-json", help="gpu_env.py output (environment + copy bandwidth); measured here if absent")
    p.add_argument("--models", help=f"comma-separated: {', '.join(MODELS)} or q/kv/head_dim "
                                    f"(default GPU: {GPU_DEFAULTS['models']}; CPU: {CPU_DEFAULTS['models']})")
    p.add_argument("--kv-dtypes", help="bf16,fp8")
    p.add_argument("--batches", help="comma-separated batch sizes")
    p.add_argument("--contexts", help="comma-separated context lengths (tokens)")
    p.add_argument("--page-size", type=int)
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="forced arms: unpacked, splitk, gqa_packed, splitk:N")
    p.add_argument("--baselines", default=",".join(BASELINE_NAMES), help="comma-separated, or none")
    p.add_argument("--time-budget-s", type=float, default=150.0, help="stop starting configurations after this")
    p.add_argument("--kv-cap-gb", type=float, default=40.0, help="skip configurations whose K+V exceed this (GB)")
    p.add_argument("--gather-cap-gb", type=float, default=24.0, help="SDPA baselines: max gathered bf16 K+V (GB)")
    p.add_argument("--flex-batches", default="1,16,64", help="batches FlexAttention runs at (a compile each)")
    p.add_argument("--flex-budget-s", type=float, default=60.0, help="FlexAttention compile time budget")
    p.add_argument("--flashinfer-status", help="flashinfer-prewarm JSON (from gpu_check.sh); compiled here if absent")
    p.add_argument("--flashinfer-jit-cap-s", type=float, default=150.0,
                   help="cap on FlashInfer's JIT when compiled here")
    p.add_argument("--check-seqs", type=int, default=2, help="sequences checked against float64 (first and last)")
    p.add_argument("--flush-mb", type=float, default=256.0, help="L2 flush buffer (decimal MB)")
    p.add_argument("--target-ms", type=float, default=20.0, help="timed work per measurement")
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--host-overhead-iters", type=int, default=2000)
    p.add_argument("--cpu-target-s", type=float, default=0.2, help="CPU mode: wall time per measurement")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    defaults = CPU_DEFAULTS if args.cpu else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    t0 = time.monotonic()
    if args.env_json and os.path.exists(args.env_json):
        with open(args.env_json) as f:
            env = json.load(f)
    else:
        env = gpu_env.probe_environment(cpu=args.cpu)
        try:
            env["copy_bandwidth"] = gpu_env.measure_copy_bandwidth(cpu=args.cpu)
        except Exception as err:  # no ratios then, but the times still count
            env["copy_bandwidth"] = {"error": _short(err)}
        env["device_label"] = gpu_env.device_label(env)
    copy = env.get("copy_bandwidth", {})
    result = {
        "schema": "metrale-attn-bench/1",
        "mode": "cpu" if args.cpu else "gpu",
        "timing_note": ("CPU backend simulator; not kernel performance" if args.cpu else
                        "median of CUDA-event-timed CUDA-graph launches on one stream, L2 flushed before each"),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_label": env.get("device_label") or gpu_env.device_label(env),
        "environment": {k: v for k, v in env.items() if k != "copy_bandwidth"},
        "copy_bandwidth": copy,
        "copy_tb_per_s": copy.get("tb_per_s"),
        "args": vars(args),
        "rows": [], "skipped": [], "not_measured": [], "host_overhead": [], "baselines": {}, "compile_s": {},
        "budget": {"time_budget_s": args.time_budget_s, "stopped_early": False},
    }
    signal.signal(signal.SIGTERM, _on_sigterm)
    sweep = None
    aborted = False
    try:
        if args.cpu:
            run_cpu(args, result)
        else:
            sweep = GpuSweep(args, result)
            sweep.run()
    except (Exception, Terminated) as err:  # write what was measured, and why it stopped
        traceback.print_exc()
        aborted = True
        if sweep is not None and sweep.pending:
            _not_measured(result, sweep.pending, f"sweep aborted: {_short(err, 120)}")
        result["budget"].update(stopped_early=True, reason=f"sweep aborted: {_short(err)}")
    finally:
        if sweep is not None and sweep.flashinfer_status is not None:
            result["flashinfer_prewarm"] = sweep.flashinfer_status
        result["budget"]["elapsed_s"] = round(time.monotonic() - t0, 1)
        summarize_baselines(result)
        result["targets"] = bench_report.evaluate_targets(result)
        paths = bench_report.write_outputs(result, args.out_dir, args.stem)
        for path in paths:
            print(f"wrote {path}")
        print(bench_report.targets_table(result["targets"]))
    return 1 if aborted else 0  # 1: cut short by an error or SIGTERM (what was measured is written)


if __name__ == "__main__":
    sys.exit(main())
