"""One implementation's cells of a check, in a process of its own: ``python -m metrale_attn.check.worker JOB OUT``.

Why a process per implementation: a CUDA fault (an illegal address, a launch failure) is
sticky, and poisons every later call of the process that met it. Here it ends this process
only: the orchestrator (``run.py``) names the implementation, the cell and the error, and the
next implementation starts on a fresh context.

``JOB`` is a JSON file: ``{"impl", "backend", "cells": [Cell.to_json()...], "seed", "copy_gib",
"check_seqs"}``. ``OUT`` is a JSON-lines file, appended one line per event, flushed at once so
that what was measured survives the process: ``env`` (the device, the backend and, where timed,
the copy bandwidth measured here), ``start`` before each cell, ``result`` after it, and
``fault`` when a sticky error ends the process (exit ``EXIT_FAULT``). A cell that fails in an
ordinary way (wrong bytes, a refusal, a peer that cannot run) is a ``result`` with its status,
and the next cell runs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import re
import sys
import time
import traceback
import zlib
from typing import Callable, Optional

import numpy as np

from .. import tolerance
from ..attention import DecodeAttention
from ..backends import get_backend
from ..problems import make_problem
from ..precompile import layer_shape, v_head_dim_of
from .cells import (ARM_OPTIONS, CORRECT_SEQ_LENS, OURS, PAGE_SIZE, Cell, cache_bytes_per_token, features_of,
                    mma_runs_simt, peer_refusal, reads_v_from_k)
from .data import check_seqs

EXIT_FAULT = 3
STICKY = re.compile(r"illegal (memory )?(address|access)|illegal instruction|unspecified launch failure|"
                    r"launch failure|misaligned address|hardware stack error|cudaErrorIllegal\w*|"
                    r"cudaErrorLaunchFailure|cudaErrorMisalignedAddress|CUDA_ERROR_(ILLEGAL|LAUNCH_FAILED|"
                    r"MISALIGNED)\w*|device-side assert|uncorrectable ECC error", re.I)
"""What a sticky CUDA error says: once one is raised, the process's context is lost."""
LSE_TOLERANCE = 2e-6
"""The lse bar (natural log; relative and absolute): the one the test suite holds every arm to."""


class Worker:
    """Runs cells on one backend and writes their events (see the module's docstring)."""

    def __init__(self, impl: str, backend: str, out_path: str, *, seed: int = 0, copy_gib: float = 2.0,
                 check_seqs: int = 2, flashinfer_status: Optional[str] = None):
        self.impl, self.out_path, self.seed = impl, out_path, seed
        self.flashinfer_status = _flashinfer_status(flashinfer_status)  # read once, not once a cell
        self.copy_gib, self.check_seqs = copy_gib, check_seqs
        self.backend = get_backend(None if backend == "auto" else backend)
        self.gpu = not self.backend.emulated
        self._timer = None  # the device side, made when the first timing cell runs
        self._pools: dict = {}  # pool_key -> the one pool alive
        self._pool_pages: dict = {}
        self._max_batch: dict = {}  # (layer, KV dtype) -> the largest batch of its timing cells
        self._attns: dict = {}  # (layer, KV dtype) -> its DecodeAttention, built once for every point

    # -- events -----------------------------------------------------------------------

    def emit(self, event: str, **fields) -> None:
        line = json.dumps({"event": event, "impl": self.impl, "t": round(time.time(), 3), **fields}, default=str)
        with open(self.out_path, "a") as f:
            f.write(line + "\n")
            f.flush()

    def run(self, cells: list[Cell]) -> int:
        self.emit("env", backend=self.backend.name, gpu=self.gpu, device=self._device())
        for c in cells:  # one pool per pool_key, big enough for all its cells: no regrowth
            if c.kind == "time":
                key = pool_key(c)
                self._pool_pages[key] = max(self._pool_pages.get(key, 0), c.batch * -(-c.context // PAGE_SIZE))
                self._max_batch[c.layer, c.kv_dtype] = max(self._max_batch.get((c.layer, c.kv_dtype), 64), c.batch)
        for cell in cells:
            self.emit("start", cell=cell.label)
            t0 = time.perf_counter()
            try:
                result = self.correct(cell) if cell.kind == "correct" else self.time(cell)
            except Exception as err:  # noqa: BLE001 - every failure is the cell's result, or the process's end
                text = f"{type(err).__name__}: {err}"
                if self.gpu and STICKY.search(text):
                    self.emit("fault", cell=cell.label, error=text[:600], traceback=traceback.format_exc()[-2000:])
                    return EXIT_FAULT
                result = dict(status="error", message=text[:600])
            self.emit("result", cell=cell.label, spec=cell.to_json(), seconds=round(time.perf_counter() - t0, 3),
                      **result)
        return 0

    def _device(self) -> dict:
        if not self.gpu:
            return {"name": "CPU backend (the CUDA sources on the host: no GPU)"}
        import cupy

        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        return {"name": name, "compute_capability": dev.compute_capability, "sm_count": props["multiProcessorCount"],
                "clock_khz": props.get("clockRate")}

    # -- correctness ------------------------------------------------------------------

    def correct(self, cell: Cell) -> dict:
        """The cell's layer on a small problem of mixed lengths, its forced arm, out and lse against
        float64 at the package's bar."""
        layer, features = cell.layer, features_of(cell.layer)
        rng = np.random.default_rng([self.seed, zlib.crc32(cell.label.encode())])
        problem = make_problem(rng, num_seqs=len(CORRECT_SEQ_LENS), num_q_heads=layer.num_q_heads,
                               num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim, page_size=PAGE_SIZE,
                               seq_lens=list(CORRECT_SEQ_LENS), kv_dtype=cell.kv_dtype, q_dtype="bf16")
        dv = v_head_dim_of(layer)
        # MLA: V is K's first dims (a view of the one cache, so the kernels may read it from K's rows);
        # else V is a cache of its own, Dv wide.
        v_cache = problem.k_cache[..., :dv] if layer.v_in_k else np.ascontiguousarray(problem.v_cache[..., :dv])
        problem = dataclasses.replace(problem, v_cache=v_cache)
        sinks = rng.normal(0.0, 2.0, layer.num_q_heads).astype(np.float32) if layer.sinks else None
        attn = self._attention(cell, len(CORRECT_SEQ_LENS), **ARM_OPTIONS[cell.arm])
        plan = attn.plan(len(CORRECT_SEQ_LENS))
        be = self.backend
        args = [be.upload(a.view(np.uint8) if a.dtype.itemsize == 1 else a)
                for a in (problem.q, problem.k_cache, problem.v_cache, problem.block_tables, problem.seq_lens)]
        if layer.v_in_k:  # the view taken on the device: the upload of a view would be a cache of its own
            args[2] = args[1][..., :dv]
        out = be.empty((*args[0].shape[:-1], dv), args[0].dtype)
        extra = {} if sinks is None else {"sinks": be.upload(sinks)}
        out, lse = attn.run(*args, k_scale=problem.k_scale, v_scale=problem.v_scale, out=out, return_lse=True, **extra)
        be.synchronize()
        got = self.perturbed(cell, np.asarray(be.host_copy(out)))
        got_lse = np.asarray(be.host_copy(lse))

        ref_features = dict(features, sinks=sinks) if layer.sinks else features
        ref_out, ref_lse = problem.reference(return_lse=True, sm_scale=layer.sm_scale, **ref_features)
        ok = tolerance.close_to_reference_mask(
            got, ref_out, v_absmax=problem.v_absmax(),
            logit_absmax=lambda: problem.logit_absmax(sm_scale=layer.sm_scale, logits_soft_cap=layer.logits_soft_cap,
                                                      sinks=sinks))
        ulps = tolerance.ulp_distance(got, tolerance.round_to(ref_out, got.dtype))
        # The ulps of the elements the near-zero allowance does not cover: those the ulp bar judges.
        judged = np.abs(got.astype(np.float64) - ref_out) > tolerance.near_zero_allowance(problem.v_absmax())
        finite = np.isfinite(ref_lse)
        lse_ok = bool(np.array_equal(np.isneginf(got_lse), np.isneginf(ref_lse))) and bool(np.allclose(
            got_lse[finite], ref_lse[finite], rtol=LSE_TOLERANCE, atol=LSE_TOLERANCE))
        lse_err = float(np.max(np.abs(got_lse[finite] - ref_lse[finite]), initial=0.0))
        status = "ok" if ok.all() and lse_ok else "FAIL"
        result = dict(status=status, arm_ran=plan.arm, splits=plan.num_splits, heads_per_cta=plan.heads_per_cta,
                      impl_ran=plan.impl, v_read_from_k=reads_v_from_k(layer, cell.kv_dtype, cell.impl),
                      outputs=int(got.size), max_ulp=int(ulps[judged].max(initial=0)),
                      outputs_off=int((~ok).sum()), lse_max_abs_err=lse_err)
        result.update(impl_verdict(cell, plan.impl))
        if result["status"] != "FALLBACK" and status != "ok":
            where = np.argwhere(~ok)
            result["message"] = (f"{int((~ok).sum())} of {got.size} outputs past the 1-ulp bar (first at "
                                 f"[seq, head, dim] {where[0].tolist()})" if len(where) else
                                 f"lse off the float64 reference by {lse_err:.3g} (bar {LSE_TOLERANCE:g})")
        return result

    def _attention(self, cell: Cell, max_batch: int, **options) -> DecodeAttention:
        """The cell's layer as a ``DecodeAttention`` of ``cell.impl`` with its features, value width and
        softmax scale (the model's, where its config gives one: Gemma 4's 1, DeepSeek's YaRN scale)."""
        layer = cell.layer
        return DecodeAttention(layer.num_q_heads, layer.num_kv_heads, layer.head_dim, PAGE_SIZE, q_dtype="bfloat16",
                               kv_dtype="fp8_e4m3" if cell.kv_dtype == "fp8" else "bfloat16", max_batch=max_batch,
                               v_head_dim=layer.v_head_dim, sm_scale=layer.sm_scale, impl=impl_argument(cell),
                               backend=self.backend, **options, **features_of(layer))

    def perturbed(self, cell: Cell, got: np.ndarray) -> np.ndarray:
        """The output as checked. A hook for the check's own tests (``tests/support/check_doubles.py``
        replaces it to stand in for a wrong kernel); here the output itself."""
        return got

    # -- timing -----------------------------------------------------------------------

    def time(self, cell: Cell) -> dict:
        """The cell's point at the policy's default launch (ours) or the peer's call: checked against
        float64 on a few sequences, then timed; % of the copy bandwidth measured in this process."""
        if not self.gpu:
            return dict(status="unavailable", message="no GPU: the CPU backend times a simulator, not a kernel")
        refusal = peer_refusal(cell)
        if refusal:
            return dict(status="unavailable", message=refusal)
        import torch

        timer, copy = self._timing_state()
        case = self._case(cell, timer)
        seqs = check_seqs(cell.batch, self.check_seqs)
        ref_cache: dict = {}
        if cell.impl in OURS:
            result, launch = self._ours(cell, case, timer, torch, seqs, ref_cache)
            mode, note = "cuda-graph", ""
        else:
            result, launch, mode, note = self._peer(cell, case, timer, seqs, ref_cache)
        if launch is None:
            return result
        timing = timer.measure(launch, mode=mode, note=note)
        # KV read (as this implementation reads it: kv_bytes), q read, out written ([B, H, Dv]).
        moved = kv_bytes(cell) + case.q.numel() * case.q.element_size() * (1 + case.v_head_dim / case.head_dim)
        moved = int(moved)
        tb_per_s = moved / (timing.median_us * 1e-6) / 1e12
        flops = call_flops(cell)
        result.update(median_us=round(timing.median_us, 3), min_us=round(timing.min_us, 3), iters=timing.iters,
                      mode=timing.mode, note=timing.note, bytes_moved=moved, tb_per_s=tb_per_s,
                      pct_of_copy=100.0 * tb_per_s / copy["tb_per_s"], copy_tb_per_s=copy["tb_per_s"],
                      flops=flops, tflops=flops / (timing.median_us * 1e-6) / 1e12, flop_per_byte=flops / moved)
        return result

    def _timing_state(self):
        """(the timer, the copy bandwidth measured in this process), made on the first timing cell."""
        if self._timer is None:
            from .bandwidth import measure_copy_bandwidth
            from .timing import GpuTimer

            self._copy = measure_copy_bandwidth(copy_gib=self.copy_gib)
            self.emit("copy", **self._copy)
            self._timer = GpuTimer()
        return self._timer, self._copy

    def _case(self, cell: Cell, timer):
        import torch

        from .data import GpuPool

        pools = self._pools
        layer = cell.layer
        key = pool_key(cell)
        pages = cell.batch * -(-cell.context // PAGE_SIZE)
        if key not in pools or pools[key].num_pages < pages:
            pools.clear()  # one pool at a time: free the last before the next
            gc.collect()
            torch.cuda.empty_cache()
            pools[key] = GpuPool(layer_shape(layer), cell.kv_dtype, PAGE_SIZE,
                                 max(pages, self._pool_pages.get(key, 0)), seed=self.seed, v_in_k=layer.v_in_k)
        case = pools[key].case(cell.batch, cell.context, layer.num_q_heads, sm_scale=layer.sm_scale)
        timer.synchronize_device()
        return case

    def _ours(self, cell: Cell, case, timer, torch, seqs, ref_cache):
        """The layer with its features (a sink logit of 0 a head where it has sinks), checked against
        float64 with them, then captured for timing; a wrong output or an mma request that the device's
        self-test turned into simt is not timed."""
        from .data import check_gpu_features, check_gpu_output

        layer, features = cell.layer, features_of(cell.layer)
        attn = self._attns.get((layer, cell.kv_dtype))
        if attn is None:
            attn = self._attns[layer, cell.kv_dtype] = self._attention(
                cell, self._max_batch.get((layer, cell.kv_dtype), max(64, cell.batch)))
        plan = attn.plan(cell.batch)
        sinks = torch.zeros(layer.num_q_heads, dtype=torch.float32, device=case.q.device) if layer.sinks else None
        extra = {} if sinks is None else {"sinks": sinks}
        out = case.q.new_empty((*case.q.shape[:-1], case.v_head_dim))
        call = lambda: attn.run(case.q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens,  # noqa: E731
                                k_scale=case.k_scale, v_scale=case.v_scale, out=out, **extra)
        launch = timer.capture_poisoned(call, out)
        out_checked = self.perturbed(cell, out)
        if features:
            ref_features = dict(features, sinks=np.zeros(layer.num_q_heads, np.float32)) if layer.sinks else features
            check = check_gpu_features(case, case.q, out_checked, seqs, ref_features)
        else:
            check = check_gpu_output(case, out_checked, seqs, ref_cache, strict=True)
        result = dict(status="ok" if check["status"] == "ok" else "FAIL", check=check, arm_ran=plan.arm,
                      splits=plan.num_splits, heads_per_cta=plan.heads_per_cta, impl_ran=plan.impl,
                      v_read_from_k=reads_v_from_k(layer, cell.kv_dtype, cell.impl))
        verdict = impl_verdict(cell, plan.impl)
        if verdict.get("status") == "FALLBACK":
            result.update(verdict)
            return result, None  # a self-test fallback's simt time is not reported as mma's
        result.update({k: v for k, v in verdict.items() if k != "status"})
        if check["status"] != "ok":
            result["message"] = check.get("message", "output past the 1-ulp bar")
            return result, None  # a wrong kernel is not timed
        return result, launch

    def _peer(self, cell: Cell, case, timer, seqs, ref_cache):
        from . import peers
        from .data import check_gpu_output
        from .timing import try_capture_torch

        try:
            if cell.impl == "sdpa":
                fn = peers.prepare_sdpa_gather(case)
            else:
                fn = peers.prepare_flashinfer(case, status=self.flashinfer_status)
            timer.synchronize_device()
            with timer.on_stream():
                out = fn()
                fn()
            timer.synchronize_device()
        except peers.Unavailable as err:
            return dict(status="unavailable", message=str(err)[:400]), None, "", ""
        check = check_gpu_output(case, out, seqs, ref_cache, strict=False)
        del out
        launch, mode, note, _ = try_capture_torch(timer, fn)
        result = dict(status="ok" if check["status"] == "ok" else "FAIL", check=check)
        return result, launch, mode, note


def impl_verdict(cell: Cell, built: str) -> dict:
    """What the kernel implementation the plan ran says of a cell of ours: nothing where it is the one
    asked for; ``simt_by_shape`` (the reason) where ``mma`` was asked of a shape it has no kernel of
    (``cells.mma_runs_simt``: every device runs simt there, by design, and the cell is judged and
    timed as simt's); else the status FALLBACK (the device failed the mma self-test), which fails."""
    if built == cell.impl:
        return {}
    why = mma_runs_simt(cell.layer) if cell.impl == "mma" and built == "simt" else None
    if why:
        return {"simt_by_shape": f"{why}: the simt kernels ran"}
    return {"status": "FALLBACK", "message": fallback_message(cell.impl, built)}


def impl_argument(cell: Cell) -> Optional[str]:
    """``DecodeAttention``'s ``impl`` for the cell: its own, except an ``mma`` cell of a shape the mma
    kernels have none of (``cells.mma_runs_simt``), which asks for the default (None) as a serving
    engine does: the default runs simt there and says why, where ``impl="mma"`` itself is refused."""
    return None if cell.impl == "mma" and mma_runs_simt(cell.layer) else cell.impl


def pool_key(cell: Cell) -> tuple:
    """The pool a timing cell draws from: shared by the cells of equal KV heads, head dims, V in K and dtype."""
    layer = cell.layer
    return layer.num_kv_heads, layer.head_dim, v_head_dim_of(layer), layer.v_in_k, cell.kv_dtype


def fallback_message(asked: str, built: str) -> str:
    return (f"asked for {asked}, the device built {built}: it failed the mma known-answer self-test "
            "(DecodeAttention warns and serves simt there); report it with this device's name")


def _flashinfer_status(path: Optional[str]) -> Optional[dict]:
    """The prewarm's status file, None without one; an unreadable one says that nothing was built."""
    if not path:
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"specs": {}, "import_error": f"the FlashInfer status {path} is unreadable"}


def kv_bytes(cell: Cell) -> int:
    """K and V bytes a call of the timing cell reads: tokens x ``cells.cache_bytes_per_token`` (each
    KV head's K row, and its V row unless this implementation takes V from K's registers: MLA bf16
    on ours). 32/8/128 bf16: 4,096 B a token; MLA 576/512 bf16 on ours: 1,152 B; on SDPA: 2,176 B."""
    return cell.batch * cell.context * cache_bytes_per_token(cell.layer, cell.kv_dtype, cell.impl)


def call_flops(cell: Cell) -> int:
    """The arithmetic of a call of the timing cell: 2 x batch x q heads x context x (head_dim + v_head_dim)
    (q.k over the keys' dims, p.v over the values'; the softmax not counted)."""
    layer = cell.layer
    return 2 * cell.batch * layer.num_q_heads * cell.context * (layer.head_dim + v_head_dim_of(layer))


def main(argv: Optional[list[str]] = None, worker_class: Callable[..., Worker] = Worker) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m metrale_attn.check.worker JOB.json OUT.jsonl", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        job = json.load(f)
    worker = worker_class(job["impl"], job["backend"], argv[1], seed=job.get("seed", 0),
                          copy_gib=job.get("copy_gib", 2.0), check_seqs=job.get("check_seqs", 2),
                          flashinfer_status=job.get("flashinfer_status"))
    code = worker.run([Cell.from_json(c) for c in job["cells"]])
    if code == EXIT_FAULT:  # a lost CUDA context can hang the interpreter's exit: leave at once
        sys.stdout.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
