"""Paged-decode benchmark sweep: ours (every arm) against the baselines, on one GPU, in one run.

This module owns the sweep's execution: the data each configuration runs on, the
correctness check before timing, the bytes a call must move, the rows of the result,
and the time budget. What runs and in which order (tiers: the decisive
configurations first) is ``sweep_plan.py``; the GPU tensors ``data.py``; timing is
``timing.py``; the baselines ``baselines.py``; the environment and copy-bandwidth ceiling
``environment.py``; JSON / markdown / plots / targets ``report.py``; the kernel
implementations and the mma self-test's verdict ``impls.py``; the static SASS model's
predictions ``predictions.py``.

What one row means (GPU):

- Configuration: a model shape (q heads / kv heads / head dim), the KV dtype (bf16,
  or fp8 e4m3 with a per-tensor scale; q and out are bf16), page size, batch and
  context (every sequence the same length; pages drawn at random from a pool, so a
  sequence's pages are scattered). One pool at a time is held, shared by the
  configurations with the same KV heads, head dim and dtype, and sized for the largest
  of them that passes ``--kv-cap-gb``; larger configurations are skipped and listed.
- Ours: ``DecodeAttention(..., backend="cupy")`` with each arm forced
  (``unpacked``: splitk off; ``splitk``: splitk auto; ``gqa_packed``: splitk off +
  gqa_pack on, where the shape fits; ``splitk:N``: pinned N splits), on each kernel
  implementation (``impl="simt"``, ``impl="mma"``), and the policy's default (flagged
  ``default`` on the forced spec with the same geometry: arm, splits, implementation,
  heads per CTA; or timed on its own). The ``heads_per_cta`` tier forces ``heads_per_cta=``
  on the mma kernels instead and marks the plan's choice; the ``features`` tier builds the
  mma kernels with one feature each (``sweep_plan.features_for``), checks each against the
  float64 reference with that feature (``reference.paged_decode`` on the host) and gives
  its time over the plain row's (``vs_plain``). A row's ``kernel_impl`` and
  ``heads_per_cta`` are what the plan of the built object runs: where the mma self-test
  failed on the device (``DecodeAttention`` warned and built simt), a forced mma spec
  is not timed but listed with status ``fallback`` and the warning.
  Arrays are PyTorch CUDA tensors (fp8 as ``torch.float8_e4m3fn``); ``run`` is given
  ``out`` so it allocates nothing.
- Check before timing: ``out`` is filled with NaN, the captured graph is launched
  once, then (1) no element of the whole output is NaN, and (2) the first and last
  sequences (``--check-seqs``) meet the package's correctness bar
  (``tolerance.assert_close_to_reference``: 1 ulp, or the near-zero absolute
  bound) against a float64 computation done on the GPU with PyTorch. Baselines get
  the same float64 comparison with a loose bar (they round P to bf16): max abs
  error <= 1% of max|reference|.
- Time: median microseconds of a CUDA-graph launch between CUDA events on one
  stream, L2 flushed before each (``timing.py``).
- Bytes: KV actually touched (tokens x kv_heads x head_dim x itemsize x 2 for K and
  V) + q + out. ``tb_per_s`` = bytes / median time, in decimal TB/s; ``pct_of_copy``
  = that over the measured device-to-device copy bandwidth. Baselines are charged
  the same bytes, so their TB/s is comparable effective bandwidth.
- Prediction: the static SASS model's row for the same arm, shape, dtypes and
  ``heads_per_cta`` (``--sass-json``), and measured % over its predicted ceiling.
- Host overhead: microseconds of Python per ``run`` call (eager, no sync, many
  calls) and per graph launch, batch 1 x 1k (or the job's context if shorter), once per
  model and KV dtype.

Time: ``--time-budget-s`` bounds the sweep. Ours runs job by job until
``--late-reserve-s`` is left, then the late phase times FlexAttention (one bf16
configuration per shape, each compile under its own cap) and FlashInfer (the specs
its JIT built by then, after waiting for those still building while the budget allows)
on the configurations already measured, in the same order; then ours resumes until the
budget is spent. What was not reached is listed as not measured.
Every ``--checkpoint-s`` the JSON and markdown are rewritten with what was measured so
far, so a run killed from outside still leaves its numbers. An error outside a single
measurement, or SIGTERM, also writes what was measured, and exits 1.

``--cpu`` runs the ``cpu`` profile on the CPU backend (the CUDA-on-CPU simulator)
through the same job loop and writers; its timings are the simulator's wall clock,
NOT kernel performance.

Usage::

    python -m benchmarks.sweep --out-dir OUT [--env-json env.json] [--time-budget-s 240]
    python -m benchmarks.sweep --profile quick --out-dir OUT     # decisive tiers only
    python -m benchmarks.sweep --cpu --out-dir /tmp/bench
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import signal
import sys
import time
import traceback
from typing import Optional

import numpy as np

from metrale_attn import DecodeAttention, problems
from metrale_attn.check.data import GpuPool, check_gpu_features, check_gpu_output, check_numpy, check_seqs
from metrale_attn.check.timing import Timing, time_host

from . import environment, impls, report
from .model.predictions import Predictions, arch_digits, call_ratio
from .model.predictions import ratio as prediction_ratio
from .steps import load_json
from .sweep_plan import (ARM_OPTIONS, BASELINE_NAMES, DEFAULT_ARMS, LATE_BASELINES, MODELS, PROFILES,  # noqa: F401
                         SOFT_CAP, Config, Job, Slot, apply_profile, arm_options, arms_for, baseline_list,
                         feature_kv_fraction, feature_options, feature_q_len, parse_models, plan_jobs, slots_for)

GB = 1e9  # decimal
HOST_OVERHEAD_CONTEXT = 1024


def make_row(config: Config, impl: str, *, timing: Optional[Timing], copy_tb_per_s: Optional[float], status: str,
             arm: Optional[str] = None, check: Optional[dict] = None, plan=None, default: bool = False,
             reason: str = "", extra: Optional[dict] = None, slot: Optional[Slot] = None,
             tier: Optional[str] = None) -> dict:
    """One result row: configuration, implementation, time, bytes, TB/s and % of copy bandwidth.

    ``impl`` is ``metrale`` (ours) or a baseline's name; ours also carries ``kernel_impl``
    (``simt``/``mma``: what the plan runs, else what the slot asked for) and ``heads_per_cta``."""
    row = config.describe()
    row.update(impl=impl, arm=arm, default=default, status=status, reason=reason, check=check)
    if tier:
        row["tier"] = tier
    if slot is not None:
        row.update(arm_label=slot.label, kernel_impl=slot.impl, impl_asked=slot.impl,
                   hpc_forced=slot.heads_per_cta is not None)
    if plan is not None:
        row.update(plan_arm=plan.arm, num_splits=plan.num_splits, items=plan.items, ctas=plan.ctas,
                   grids=[list(g.grid) for g in plan.launches], plan_reason=plan.reason,
                   kernels=[g.kernel for g in plan.launches], plan_heads_per_cta=plan.heads_per_cta,
                   kernel_impl=plan.impl, heads_per_cta=plan.heads_per_cta)
    if slot is not None and slot.heads_per_cta is not None:
        row["heads_per_cta"] = slot.heads_per_cta  # forced (plan_heads_per_cta says what the plan made of it)
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


class CompileTimeout(Exception):
    """A baseline's compile ran past its own cap (``time_cap``)."""


def _on_sigterm(signum, frame):
    raise Terminated(f"terminated by signal {signum} (the caller's time cap)")


@contextlib.contextmanager
def time_cap(seconds: Optional[float]):
    """Raise ``CompileTimeout`` in the main thread after ``seconds`` (SIGALRM); None: no cap."""
    if seconds is None or not hasattr(signal, "setitimer"):
        yield
        return

    def fire(signum, frame):
        raise CompileTimeout(f"its own cap of {seconds:.0f} s was reached")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(float(seconds), 0.1))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _short(err: BaseException, limit: int = 400) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def progress_line(elapsed: float, job: Job, rows: list[dict], seconds: float, gpu: bool) -> str:
    """``[bench 37s] decisive-bf16 llama-3-8b bf16 b64 16k: unp 88% spk* 91% sdpa 60% (1.3s)``:
    one short line per job (``*``: the policy's default; ``:status`` where nothing was timed)."""
    parts = []
    for r in rows:
        label = report.short_label(r) + ("*" if r.get("default") or r.get("hpc_choice") else "")
        if r.get("median_us") is None:
            parts.append(f"{label}:{r['status']}")
        elif gpu and r.get("pct_of_copy") is not None:
            parts.append(f"{label} {r['pct_of_copy']:.0f}%")
        else:
            parts.append(f"{label} {r['median_us']:.0f}us")
    return f"[bench {elapsed:.0f}s] {job.tier} {job.config.short()}: {' '.join(parts)} ({seconds:.1f}s)"


# =====================================================================================
# The job loop (backend-agnostic)
# =====================================================================================


class Sweep:
    """Runs the planned jobs in order within the time budget and fills ``result``.

    Subclasses provide the data (``case``), the timing of ours (``time_ours``) and, on
    the GPU, the baselines (``measure_baseline``, ``baseline_unavailable``)."""

    backend = ""
    gpu = False
    flashinfer_status = None  # the FlashInfer prewarm's status as last read (GPU)

    def __init__(self, args, result: dict):
        self.args, self.result = args, result
        self.arms = args.arms.split(",")
        self.baselines = baseline_list(args.baselines)
        self.copy_tb = result["copy_tb_per_s"]
        self.pending: list[Job] = []  # not measured yet (listed as such if the run is cut short)
        self.done: list[Job] = []
        self.attns: dict = {}
        self.max_batch = 1
        self.on_checkpoint = None  # called every --checkpoint-s with nothing in flight
        self.t_start = self.last_checkpoint = time.monotonic()
        self.predictions = Predictions.load(args.sass_json, self.arch())
        result["sass_model"] = self.predictions.describe()
        result["kernel_impls"] = dict(impls=list(impls.IMPLS), default_impl=None,
                                      selftest=impls.selftest_record(None, self.backend))
        self._selftest_seen = False
        result["hpc_sweep"] = {"status": "not planned", "choices": {}}

    # -- hooks ------------------------------------------------------------------

    def arch(self) -> str:
        return "sm_90"  # the CPU backend stands in for the default target, hopper

    def prepare(self, jobs: list[Job]) -> None:
        pass

    def case(self, config: Config):
        raise NotImplementedError

    def release_case(self) -> None:
        pass

    def time_ours(self, config: Config, case, attn) -> tuple[dict, Timing]:
        raise NotImplementedError

    def host_overhead(self, job: Job) -> None:
        pass

    def measure_baseline(self, job: Job, case, name: str) -> dict:
        raise NotImplementedError

    def baseline_unavailable(self, config: Config, name: str) -> Optional[str]:
        """Why ``name`` cannot run on ``config`` without building its data first, or None."""
        return None

    def wait_for_builds(self, name: str, configs: list[Config]) -> None:
        """Before the late phase times ``name``: wait for what it is still building, if that is useful."""

    # -- the loop -----------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def left(self) -> float:
        return self.args.time_budget_s - self.elapsed()

    def run(self) -> None:
        args, result = self.args, self.result
        jobs = plan_jobs(args)
        result["plan"] = [dict(tier=j.tier, kind=j.kind, config=j.config.short()) for j in jobs]
        cap = args.kv_cap_gb * GB
        runnable, skipped = [], set()
        for j in jobs:
            if j.config.kv_bytes <= cap:
                runnable.append(j)
            elif j.config not in skipped:
                skipped.add(j.config)
                result["skipped"].append(dict(j.config.describe(), tier=j.tier, reason=(
                    f"KV {j.config.kv_bytes / GB:.3g} GB > cap {args.kv_cap_gb:g} GB (--kv-cap-gb)")))
        self.max_batch = max([j.config.batch for j in runnable] + [1])
        if any(j.kind == "hpc" for j in runnable):
            result["hpc_sweep"]["status"] = "planned"
        self.prepare(runnable)
        self.pending = list(runnable)
        late = [b for b in self.baselines if b in LATE_BASELINES]
        self._drain(args.time_budget_s - (args.late_reserve_s if late else 0))
        if late:
            self.late_phase(late)
        self._drain(args.time_budget_s)
        if self.pending:
            _not_measured(result, self.pending, f"time budget of {args.time_budget_s:g} s spent")

    def _drain(self, until: float) -> None:
        while self.pending and self.elapsed() < until:
            job = self.pending[0]
            self.run_job(job)  # still pending while it runs: a SIGTERM lists it as not measured
            self.done.append(self.pending.pop(0))

    def run_job(self, job: Job) -> None:
        rows, t0 = self.result["rows"], time.monotonic()
        first = len(rows)
        try:
            case = self.case(job.config)
            try:
                if job.kind == "hpc":
                    self._run_hpc(job, case)
                elif job.kind == "features":
                    self._run_features(job, case)
                else:
                    self._run_arms(job, case)
            finally:
                del case
                self.release_case()
        except Exception as err:  # the job's data or a kernel build failed: record it, go on
            traceback.print_exc()
            rows.append(make_row(job.config, "metrale", timing=None, copy_tb_per_s=self.copy_tb, status="failed",
                                 reason=f"job aborted: {_short(err)}", tier=job.tier))
        print(progress_line(self.elapsed(), job, rows[first:], time.monotonic() - t0, self.gpu), flush=True)
        self.maybe_checkpoint()

    def maybe_checkpoint(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.on_checkpoint and (force or now - self.last_checkpoint >= self.args.checkpoint_s):
            self.last_checkpoint = now
            try:
                self.on_checkpoint()
            except Exception as err:  # a checkpoint must never stop the sweep
                print(f"[bench] checkpoint failed: {_short(err)}", file=sys.stderr, flush=True)

    # -- ours ---------------------------------------------------------------------

    def attn(self, config: Config, slot: Slot):
        """The memoized ``DecodeAttention`` of a slot; a construction error is cached and raised again,
        and so is ``impls.FellBack`` for a forced mma slot that built simt (the self-test failed)."""
        key = (config.model, config.kv_dtype, slot.arm, slot.impl, slot.heads_per_cta, slot.feature)
        if key not in self.attns:
            s, t0 = config.shape, time.monotonic()
            try:
                built = impls.build(
                    DecodeAttention, s.num_q_heads, s.num_kv_heads, s.head_dim, config.page_size, q_dtype="bf16",
                    kv_dtype=config.kv_dtype, max_batch=self.max_batch, backend=self.backend,
                    impl=slot.impl, heads_per_cta=slot.heads_per_cta, **arm_options(slot.arm),
                    **feature_options(slot.feature, self.args.feature_window))
                self._note_selftest(built)
                self.attns[key] = impls.FellBack(built.fallback_reason()) if (
                    built.fell_back and slot.impl) else built.attn
            except (ValueError, RuntimeError) as err:  # the build refuses this combination: say why, per slot
                self.attns[key] = err
            self.result["compile_s"][f"{config.model}/{config.kv_dtype}/{slot.label}"] = round(
                time.monotonic() - t0, 2)
        attn = self.attns[key]
        if isinstance(attn, Exception):
            raise attn
        return attn

    def _note_selftest(self, built) -> None:
        """The first build that wants mma decides the self-test's record (the device runs the test once)."""
        if self._selftest_seen or built.wanted != "mma":
            return
        self._selftest_seen = True
        record = impls.selftest_record(built, self.backend)
        self.result["kernel_impls"]["selftest"] = record
        print(f"[bench {self.elapsed():.0f}s] mma self-test: {record['status']} ({record['detail']})", flush=True)

    @staticmethod
    def geometry(plan) -> tuple:
        """What makes a forced slot the policy's choice: its arm, splits, implementation and heads per CTA."""
        return (plan.arm, plan.num_splits, plan.impl, plan.heads_per_cta)

    def _run_arms(self, job: Job, case) -> None:
        config, rows = job.config, self.result["rows"]
        default_attn = self.attn(config, Slot("default"))
        default_plan = default_attn.plan(config.batch)
        if self.result["kernel_impls"]["default_impl"] is None:
            self.result["kernel_impls"]["default_impl"] = default_plan.impl
        want, matched = self.geometry(default_plan), False
        for slot in slots_for(job, self.arms):
            try:
                attn = self.attn(config, slot)
            except impls.FellBack as err:
                rows.append(self._unavailable(job, slot, str(err), status="fallback"))
                continue
            except ValueError as err:
                rows.append(self._unavailable(job, slot, _short(err)))
                continue
            plan = attn.plan(config.batch)
            is_default = not matched and self.geometry(plan) == want
            matched |= is_default
            rows.append(self.measure_ours(job, case, attn, slot, plan, is_default))
        if not matched:  # the policy's geometry is none of the forced specs': time it as its own row
            rows.append(self.measure_ours(job, case, default_attn, Slot("default"), default_plan, True))
        self.host_overhead(job)
        for name in job.baselines:
            rows.append(self.measure_baseline(job, case, name))

    def _run_hpc(self, job: Job, case) -> None:
        """``heads_per_cta`` forced to each choice of the group on the mma kernels, the policy's arm; the
        plan's own choice marked."""
        config, rows = job.config, self.result["rows"]
        try:
            choice = self.attn(config, Slot("default", impls.SWEEP_IMPL)).plan(config.batch).heads_per_cta
        except impls.FellBack:
            choice = None
        self.result["hpc_sweep"]["choices"][f"{config.model} b{config.batch}"] = choice
        for slot in slots_for(job, self.arms):
            extra = dict(sweep="heads_per_cta", hpc_choice=slot.heads_per_cta == choice)
            try:
                attn = self.attn(config, slot)
            except impls.FellBack as err:
                rows.append(self._unavailable(job, slot, str(err), status="fallback", extra=extra))
                continue
            except ValueError as err:  # a heads_per_cta the build refuses: the message is the row's reason
                rows.append(self._unavailable(job, slot, _short(err), extra=extra))
                continue
            rows.append(self.measure_ours(job, case, attn, slot, attn.plan(config.batch), False, extra))

    def _run_features(self, job: Job, case) -> None:
        """Plain decode and each feature on the mma kernels, the policy's arm; each row carries
        its time against the plain row's (``vs_plain``) and the share of the K/V it reads."""
        config, rows = job.config, self.result["rows"]
        plain_us = None
        for slot in slots_for(job, self.arms):
            extra = dict(sweep="features", feature=slot.feature, q_len=feature_q_len(slot.feature),
                         kv_fraction=feature_kv_fraction(slot.feature, self.args.feature_window, config.context))
            try:
                attn = self.attn(config, slot)
            except impls.FellBack as err:
                rows.append(self._unavailable(job, slot, str(err), status="fallback", extra=extra))
                continue
            except RuntimeError as err:  # the device's mma disagrees, and only mma serves the features
                rows.append(self._unavailable(job, slot, _short(err), status="fallback", extra=extra))
                continue
            except ValueError as err:
                rows.append(self._unavailable(job, slot, _short(err), extra=extra))
                continue
            row = self.measure_ours(job, case, attn, slot, attn.plan(config.batch, extra["q_len"]), False, extra)
            if row.get("median_us") is not None:
                if slot.feature == "plain":
                    plain_us = row["median_us"]
                row["vs_plain"] = None if plain_us is None else row["median_us"] / plain_us
            rows.append(row)

    def _unavailable(self, job: Job, slot: Slot, reason: str, status: str = "unavailable",
                     extra: Optional[dict] = None) -> dict:
        return make_row(job.config, "metrale", arm=slot.arm, timing=None, copy_tb_per_s=self.copy_tb, status=status,
                        reason=reason, slot=slot, tier=job.tier, extra=extra)

    def measure_ours(self, job: Job, case, attn, slot: Slot, plan, is_default: bool,
                     extra: Optional[dict] = None) -> dict:
        config = job.config
        common = dict(arm=slot.arm, copy_tb_per_s=self.copy_tb, plan=plan, default=is_default, slot=slot,
                      tier=job.tier, extra=extra)
        try:
            check, timing = self.time_ours(config, case, attn, slot.feature)
            row = make_row(config, "metrale", timing=timing, status="ok" if check["status"] == "ok" else "wrong",
                           check=check, **common)
        except Exception as err:
            traceback.print_exc()
            row = make_row(config, "metrale", timing=None, status="failed", reason=_short(err), **common)
        prediction = self.predictions.lookup(
            arm=plan.arm, q_heads=config.shape.num_q_heads, kv_heads=config.shape.num_kv_heads,
            head_dim=config.shape.head_dim, q_dtype="bf16", kv_dtype=config.kv_dtype,
            heads_per_cta=plan.heads_per_cta, impl=plan.impl, batch=config.batch, context=config.context)
        row.update(sass=prediction, pred_ratio=prediction_ratio(row.get("pct_of_copy"), prediction),
                   call_ratio=call_ratio(row.get("pct_of_copy"), prediction))
        return row

    # -- the late phase: FlexAttention and FlashInfer, after ours --------------------

    def late_phase(self, names: list[str]) -> None:
        measured = [j for j in self.done if j.kind == "arms"]
        print(f"[bench {self.elapsed():.0f}s] late phase: {', '.join(names)} on up to {len(measured)} "
              f"configurations, {self.left():.0f} s left", flush=True)
        self.result["late_phase"] = {"start_s": round(self.elapsed(), 1), "baselines": names}
        if "flex_paged" in names:
            self._late_flex(measured)
        if "flashinfer" in names:
            self.wait_for_builds("flashinfer", [j.config for j in measured])
            self._late_each("flashinfer", measured, min_left_s=self.args.flashinfer_min_s)
        self.result["late_phase"]["end_s"] = round(self.elapsed(), 1)

    def _late_row(self, job: Job, name: str, case=None, reason: str = "") -> dict:
        t0 = time.monotonic()
        if case is None:
            row = make_row(job.config, name, timing=None, copy_tb_per_s=self.copy_tb, status="unavailable",
                           reason=reason, tier=job.tier)
        else:
            row = self.measure_baseline(job, case, name)
        row["phase"] = "late"
        self.result["rows"].append(row)
        print(progress_line(self.elapsed(), job, [row], time.monotonic() - t0, self.gpu), flush=True)
        self.maybe_checkpoint()
        return row

    def _late_flex(self, measured: list[Job]) -> None:
        """One bf16 configuration per shape (the first measured at a ``--flex-batches`` batch), each
        compile under its own cap, never eating into FlashInfer's reserve."""
        args, shapes = self.args, set()
        chosen = []
        for job in measured:
            c = job.config
            if c.kv_dtype == "bf16" and c.shape not in shapes and c.batch in _ints(args.flex_batches):
                shapes.add(c.shape)
                chosen.append(job)
        entry = self.result["baselines"].setdefault("flex_paged", {})
        entry["reason"] = (f"one bf16 configuration per shape ({len(chosen)} chosen), timed last, each compile capped "
                           f"at {args.flex_compile_cap_s:g} s, {args.flex_budget_s:g} s in all")
        spent = 0.0
        for job in chosen:
            left = self.left() - args.flashinfer_reserve_s
            if spent >= args.flex_budget_s or left < args.flex_min_s:
                why = (f"FlexAttention compile budget of {args.flex_budget_s:g} s spent" if spent >= args.flex_budget_s
                       else f"{max(left, 0):.0f} s left before FlashInfer's reserve (< {args.flex_min_s:g} s)")
                self._late_row(job, "flex_paged", reason=why)
                continue
            t0 = time.monotonic()
            case = self.case(job.config)
            try:
                with time_cap(min(args.flex_compile_cap_s, left, args.flex_budget_s - spent)):
                    self._late_row(job, "flex_paged", case)
            finally:
                del case
                self.release_case()
                spent += time.monotonic() - t0
        entry["compile_spent_s"] = round(spent, 1)

    def _late_each(self, name: str, measured: list[Job], min_left_s: float) -> None:
        reached = 0
        for job in measured:
            if self.left() < min_left_s:
                break
            reached += 1
            why = self.baseline_unavailable(job.config, name)
            if why:
                self._late_row(job, name, reason=why)
                continue
            case = self.case(job.config)
            try:
                self._late_row(job, name, case)
            finally:
                del case
                self.release_case()
        if reached < len(measured):
            self.result["baselines"].setdefault(name, {})["reason"] = (
                f"reached {reached} of {len(measured)} measured configurations before the budget ran out")


# =====================================================================================
# CPU backend (the CUDA-on-CPU simulator)
# =====================================================================================


def _ints(text) -> list[int]:
    return [int(x) for x in str(text).split(",") if x.strip()]


class CpuSweep(Sweep):
    """The CPU dry run: NumPy problems per configuration, the simulator's wall clock."""

    backend = "cpu"

    def __init__(self, args, result):
        super().__init__(args, result)
        self._seed = args.seed

    def case(self, config: Config):
        self._seed += 1
        s = config.shape
        p = problems.make_problem(np.random.default_rng(self._seed), num_seqs=config.batch,
                                  num_q_heads=s.num_q_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                                  page_size=config.page_size, seq_lens=config.context, kv_dtype=config.kv_dtype,
                                  q_dtype="bf16", layout="NHD")
        return p, p.reference(), p.v_absmax()

    def time_ours(self, config: Config, case, attn, feature: Optional[str] = None):
        p, ref, v_absmax = case
        q, sinks = p.q, None
        if feature not in (None, "plain"):
            rng = np.random.default_rng(self._seed)
            if feature == "multi_token":
                q = rng.standard_normal((config.batch, feature_q_len(feature)) + p.q.shape[1:]).astype(p.q.dtype)
            if feature == "sinks":
                sinks = feature_sinks(config.shape.num_q_heads, config.context)
            ref = p.reference(q=q, **reference_features(feature, self.args.feature_window, sinks))
        out = np.full(q.shape, np.nan, dtype=p.q.dtype)
        table = page_table_and_scales(feature, p.block_tables, p.seq_lens, config.page_size, p.k_scale, p.v_scale)
        call = lambda: attn.run(q, p.k_cache, p.v_cache, out=out, sinks=sinks, **table)  # noqa: E731
        call()
        check = check_numpy(out, ref, v_absmax, seqs=list(range(config.batch)))
        return check, time_host(call, min_iters=2, target_s=self.args.cpu_target_s)


def page_table_and_scales(feature: Optional[str], block_tables: np.ndarray, seq_lens: np.ndarray, page_size: int,
                          k_scale: float, v_scale: float) -> dict:
    """``run``'s page-table and scale arguments for a feature row, as NumPy arrays: the dense table
    and host floats, or (``csr``) the same pages in FlashInfer's CSR form, or (``device_scales``)
    the same scales as one-element float32 arrays. Built before timing: no row times a conversion."""
    if feature == "device_scales":
        return dict(block_tables=block_tables, seq_lens=seq_lens, k_scales=np.array([k_scale], np.float32),
                    v_scales=np.array([v_scale], np.float32))
    if feature == "csr":
        return dict(k_scale=k_scale, v_scale=v_scale, **csr_page_table(block_tables, seq_lens, page_size))
    return dict(block_tables=block_tables, seq_lens=seq_lens, k_scale=k_scale, v_scale=v_scale)


def csr_page_table(block_tables: np.ndarray, seq_lens: np.ndarray, page_size: int) -> dict:
    """FlashInfer's ``kv_indptr``, ``kv_indices``, ``kv_last_page_len`` (int32) of a dense table:
    each sequence's used pages, one sequence after another; a sequence of no keys has no page
    (and a last-page length of 0)."""
    lens = np.asarray(seq_lens, np.int64)
    pages = -(-lens // page_size)
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    used = np.arange(block_tables.shape[1])[None, :] < pages[:, None]
    indices = np.asarray(block_tables)[used].astype(np.int32)  # row-major: sequence by sequence, in page order
    last = np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32)
    return dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)


def feature_sinks(num_q_heads: int, context: int) -> np.ndarray:
    """Sink logits of the sinks row: about the keys' own mass (ln context, scores ~ N(0, 1)),
    spread over the heads, so that the sink moves every output."""
    return (math.log(max(context, 1)) + np.linspace(-2.0, 2.0, num_q_heads)).astype(np.float32)


def reference_features(feature: Optional[str], window_left: int, sinks) -> dict:
    """``reference.paged_decode``'s keyword arguments for a feature row."""
    if feature == "window":
        return dict(window_left=window_left)
    if feature == "soft_cap":
        return dict(logits_soft_cap=SOFT_CAP)
    if feature == "sinks":
        return dict(sinks=sinks)
    return {}


# =====================================================================================
# GPU
# =====================================================================================


class GpuSweep(Sweep):
    """The sweep on one GPU through CuPy (ours) and PyTorch (data, baselines)."""

    backend = "cupy"
    gpu = True

    def __init__(self, args, result: dict):
        import cupy  # noqa: F401  (the backend; fail early with a clear error)
        import torch

        from metrale_attn.check.timing import GpuTimer  # looked up at construction: a test substitutes it

        super().__init__(args, result)
        self.torch = torch
        self.timer = GpuTimer(flush_bytes=int(args.flush_mb * 1e6), target_ms=args.target_ms,
                              max_iters=args.max_iters)
        self.flashinfer_status = None
        self.pool: Optional[GpuPool] = None
        self.pool_pages: dict = {}
        self._ref_cache: dict = {}
        self._overhead_done: set = set()

    def arch(self) -> str:
        cc = self.result.get("environment", {}).get("device", {}).get("compute_capability")
        return f"sm_{arch_digits(cc)}" if cc else "sm_90"

    def prepare(self, jobs: list[Job]) -> None:
        for j in jobs:  # a pool per key big enough for every configuration that shares it: no regrowth
            key = j.config.pool_key
            self.pool_pages[key] = max(self.pool_pages.get(key, 0), j.config.pages)
        if "flashinfer" in self.baselines:
            self._load_flashinfer_status([j.config for j in jobs])

    # -- data -------------------------------------------------------------------

    def case(self, config: Config):
        torch = self.torch
        key = config.pool_key
        if self.pool is None or (self.pool.shape.num_kv_heads, self.pool.shape.head_dim, self.pool.kv_dtype,
                                 self.pool.page_size) != key or self.pool.num_pages < config.pages:
            self.pool = None  # one pool at a time: free the last before the next
            gc.collect()
            torch.cuda.empty_cache()
            t0 = time.monotonic()
            self.pool = GpuPool(config.shape, config.kv_dtype, config.page_size,
                                max(self.pool_pages.get(key, 0), config.pages), seed=self.args.seed)
            print(f"[bench {self.elapsed():.0f}s] pool {config.shape.num_kv_heads}x{config.shape.head_dim} "
                  f"{config.kv_dtype}: {self.pool.nbytes / GB:.1f} GB in {time.monotonic() - t0:.1f} s", flush=True)
        self._ref_cache = {}
        case = self.pool.case(config.batch, config.context, config.shape.num_q_heads)
        # The case was made on PyTorch's default stream; everything after runs on the timer's
        # (non-blocking) stream: wait for the inputs first.
        self.timer.synchronize_device()
        return case

    def release_case(self) -> None:
        self._ref_cache = {}
        gc.collect()
        self.torch.cuda.empty_cache()

    # -- ours -----------------------------------------------------------------

    def _ours_call(self, case, attn, out):
        return lambda: attn.run(case.q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens,
                                k_scale=case.k_scale, v_scale=case.v_scale, out=out)

    def time_ours(self, config: Config, case, attn, feature: Optional[str] = None):
        seqs = check_seqs(config.batch, self.args.check_seqs)
        if feature in (None, "plain"):
            out = self.torch.empty_like(case.q)
            launch = self.timer.capture_poisoned(self._ours_call(case, attn, out), out)
            check = check_gpu_output(case, out, seqs, self._ref_cache, strict=True)
            return check, self.timer.measure(launch)
        torch, q, sinks = self.torch, case.q, None
        if feature == "multi_token":
            q = torch.randn((config.batch, feature_q_len(feature)) + tuple(case.q.shape[1:]), device=case.q.device,
                            generator=self.pool.gen).to(case.q.dtype)
        if feature == "sinks":
            sinks = torch.from_numpy(feature_sinks(config.shape.num_q_heads, config.context)).to(case.q.device)
        out = torch.empty_like(q)
        table = {k: torch.from_numpy(v).to(case.q.device) if isinstance(v, np.ndarray) else v
                 for k, v in page_table_and_scales(feature, case.block_tables.cpu().numpy(), case.seq_lens.cpu().numpy(),
                                                   case.page_size, case.k_scale, case.v_scale).items()}
        call = lambda: attn.run(q, case.k_pool, case.v_pool, out=out, sinks=sinks, **table)  # noqa: E731
        launch = self.timer.capture_poisoned(call, out)
        features = reference_features(feature, self.args.feature_window,
                                      None if sinks is None else sinks.cpu().numpy())
        check = check_gpu_features(case, q, out, seqs, features)
        return check, self.timer.measure(launch)

    def host_overhead(self, job: Job) -> None:
        """Python microseconds per call at batch 1 x 1k: eager ``run`` (no sync) and a graph launch,
        for every spec built so far for this model and KV dtype (once per pair)."""
        config = job.config
        iters = self.args.host_overhead_iters
        pair = (config.model, config.kv_dtype)
        if not iters or pair in self._overhead_done:
            return
        self._overhead_done.add(pair)
        torch, timer = self.torch, self.timer
        context = min(HOST_OVERHEAD_CONTEXT, config.context)  # short: the host's time, not the GPU's, is measured
        case = self.pool.case(1, context, config.shape.num_q_heads)
        timer.synchronize_device()
        for (model, kv, arm, impl, hpc, feature), attn in list(self.attns.items()):
            if (model, kv) != pair or hpc is not None or feature is not None or isinstance(attn, Exception):
                continue
            label = Slot(arm, impl).label
            try:
                out = torch.empty_like(case.q)
                call = self._ours_call(case, attn, out)
                eager = timer.host_overhead_us(call, iters=iters)
                launch = timer.capture_cupy(call)
                graph = timer.host_overhead_us(launch, iters=iters)
                gpu = timer.measure(launch)
                self.result["host_overhead"].append(dict(
                    model=model, kv_dtype=kv, batch=1, context=context, arm=label,
                    plan_arm=attn.plan(1).arm, iters=iters, eager_run_us=eager, graph_launch_us=graph,
                    gpu_median_us=gpu.median_us))
            except Exception as err:
                self.result["host_overhead"].append(dict(model=model, kv_dtype=kv, arm=label, error=_short(err)))

    # -- baselines --------------------------------------------------------------

    def baseline_unavailable(self, config: Config, name: str) -> Optional[str]:
        if name != "flashinfer":
            return None
        from . import baselines

        status = self._load_flashinfer_status(None)
        spec = baselines.flashinfer_spec(config.shape.num_q_heads, config.shape.num_kv_heads,
                                            config.shape.head_dim, config.kv_dtype)
        entry = status.get("specs", {}).get(spec)
        if entry is None:
            return status.get("import_error") or f"FlashInfer spec {spec} was not compiled ahead of the run"
        if entry.get("status") != "ok":
            return f"FlashInfer spec {spec}: JIT prewarm {entry.get('status')}: {entry.get('reason', '')}"[:400]
        return None

    def wait_for_builds(self, name: str, configs: list[Config]) -> None:
        """FlashInfer specs its JIT is still building when the late phase starts: the GPU has nothing
        else left to do, so wait for them while the budget still leaves time to time every configuration."""
        from . import baselines

        if name != "flashinfer":
            return
        specs = {baselines.flashinfer_spec(c.shape.num_q_heads, c.shape.num_kv_heads, c.shape.head_dim,
                                                 c.kv_dtype) for c in configs}
        t0, said = time.monotonic(), False
        while self.left() > self.args.flashinfer_min_s * len(configs) + 5:
            pending = baselines.pending_builds(self._load_flashinfer_status(None), sorted(specs))
            if not pending:
                break
            if not said:
                print(f"[bench {self.elapsed():.0f}s] waiting for FlashInfer's JIT: {', '.join(pending)}", flush=True)
                said = True
            time.sleep(2.0)
        if said:
            self.result.setdefault("late_phase", {})["flashinfer_wait_s"] = round(time.monotonic() - t0, 1)

    def measure_baseline(self, job: Job, case, name: str) -> dict:
        from . import baselines
        from metrale_attn.check.timing import try_capture_torch

        config = job.config
        timer, args = self.timer, self.args
        row = lambda **kw: make_row(config, name, copy_tb_per_s=self.copy_tb, tier=job.tier, **kw)  # noqa: E731
        s = config.shape
        t0 = time.monotonic()
        seqs = check_seqs(config.batch, args.check_seqs)
        try:
            if name.startswith("sdpa"):
                need = baselines.gathered_bytes(config.batch, config.context, s.num_kv_heads, s.head_dim)
                if need > args.gather_cap_gb * GB:
                    raise baselines.Unavailable(f"gathered bf16 K/V would take {need / GB:.1f} GB > "
                                                f"{args.gather_cap_gb:g} GB (--gather-cap-gb)")
                fn = baselines.BASELINES[name][1](case)
            elif name == "flex_paged":
                fn = baselines.prepare_flex_paged(case)
            elif name == "flashinfer":
                fn = baselines.prepare_flashinfer(case, status=self._load_flashinfer_status(None))
            else:
                raise baselines.Unavailable(f"unknown baseline {name}")
            timer.synchronize_device()  # what prepare made on the default stream, before our stream reads it
            with timer.on_stream():
                out = fn()  # first call: compiles (flex), allocates
                fn()
            timer.synchronize_device()
            check = check_gpu_output(case, out, seqs, self._ref_cache, strict=False)
            del out
            launch, mode, note, _ = try_capture_torch(timer, fn)
            timing = timer.measure(launch, mode=mode, note=note)
            return row(timing=timing, status="ok" if check["status"] == "ok" else "wrong", check=check,
                       extra=dict(setup_s=round(time.monotonic() - t0, 2)))
        except baselines.Unavailable as err:
            return row(timing=None, status="unavailable", reason=str(err))
        except CompileTimeout as err:
            self._settle()
            return row(timing=None, status="timeout", reason=f"{name}: {err}",
                       extra=dict(setup_s=round(time.monotonic() - t0, 2)))
        except Exception as err:
            traceback.print_exc()
            self._settle()
            return row(timing=None, status="failed", reason=_short(err))

    def _settle(self) -> None:
        try:
            self.torch.cuda.synchronize()
        except Exception:
            pass

    def _load_flashinfer_status(self, configs: Optional[list[Config]]) -> dict:
        """The prewarm's status: re-read from ``--flashinfer-status`` each time (the JIT runs beside
        the sweep and writes it as specs finish); without that file, compiled here once."""
        from . import baselines

        args = self.args
        if args.flashinfer_status:  # compiled ahead (gpu_check.sh): never compile here, whatever it says
            try:
                with open(args.flashinfer_status) as f:
                    self.flashinfer_status = json.load(f)
            except (OSError, ValueError) as err:
                self.flashinfer_status = {"specs": {}, "import_error": f"prewarm status unreadable: {err}"}
            return self.flashinfer_status
        if self.flashinfer_status is None and configs is not None:
            shapes = sorted({(c.shape.num_q_heads, c.shape.num_kv_heads, c.shape.head_dim) for c in configs})
            dtypes = sorted({c.kv_dtype for c in configs})
            t0 = time.monotonic()
            self.flashinfer_status = baselines.flashinfer_prewarm(shapes, dtypes,
                                                                  timeout_s=args.flashinfer_jit_cap_s)
            self.flashinfer_status["elapsed_s"] = round(time.monotonic() - t0, 1)
        return self.flashinfer_status or {"specs": {}}


def _not_measured(result: dict, jobs: list[Job], reason: str) -> None:
    result["budget"]["stopped_early"] = True
    result["budget"]["reason"] = reason
    for j in jobs:
        result["not_measured"].append(dict(j.config.describe(), tier=j.tier, kind=j.kind, reason=reason))


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
    p.add_argument("--cpu", action="store_true", help="the cpu profile on the CPU backend simulator (no GPU)")
    p.add_argument("--profile", choices=sorted(PROFILES), default="full",
                   help="full: every tier and baseline; quick: the decisive tiers, no baselines")
    p.add_argument("--out-dir", default=".", help="where the JSON, markdown and plots go")
    p.add_argument("--stem", help="file name stem (default: DATE_DEVICE)")
    p.add_argument("--env-json", help="environment.py output (environment + copy bandwidth); measured here if absent")
    p.add_argument("--models", help=f"the rest tier's models, comma-separated: {', '.join(MODELS)} or "
                                    "q/kv/head_dim (default: the profile's)")
    p.add_argument("--kv-dtypes", help="the rest tier's KV dtypes: bf16,fp8")
    p.add_argument("--batches", help="the rest tier's batch sizes")
    p.add_argument("--contexts", help="the rest tier's context lengths (tokens)")
    p.add_argument("--page-size", type=int)
    p.add_argument("--decisive", help="decisive configurations MODEL:BATCH:CONTEXT, comma-separated, or none")
    p.add_argument("--decisive-dtypes", help="one decisive tier per KV dtype, in this order")
    p.add_argument("--hpc-models", help="heads_per_cta tier: models, comma-separated, or none (each sweeps every "
                                        "heads_per_cta its group allows)")
    p.add_argument("--hpc-batches", help="heads_per_cta tier: batches, or none")
    p.add_argument("--hpc-context", type=int, help="heads_per_cta tier: context")
    p.add_argument("--features", help="features tier: MODEL:BATCH:CONTEXT configurations, or none (each times "
                                      "plain decode and every feature of sweep_plan.FEATURES on the mma kernels)")
    p.add_argument("--features-dtypes", help="features tier: KV dtypes (bf16 times sweep_plan.FEATURES, fp8 "
                                             "sweep_plan.FP8_FEATURES)")
    p.add_argument("--feature-window", type=int, help="features tier: the window row's window_left")
    p.add_argument("--rest", choices=("on", "off"), help="run the rest tier (the grid)")
    p.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="forced arms: unpacked, splitk, gqa_packed, splitk:N")
    p.add_argument("--baselines", help="comma-separated, or none (default: the profile's)")
    p.add_argument("--time-budget-s", type=float, default=240.0, help="stop starting jobs after this")
    p.add_argument("--late-reserve-s", type=float, default=60.0,
                   help="budget kept for the late phase (FlexAttention, FlashInfer)")
    p.add_argument("--checkpoint-s", type=float, default=30.0, help="rewrite JSON + markdown this often")
    p.add_argument("--kv-cap-gb", type=float, default=40.0, help="skip configurations whose K+V exceed this (GB)")
    p.add_argument("--gather-cap-gb", type=float, default=24.0, help="SDPA baselines: max gathered bf16 K+V (GB)")
    p.add_argument("--flex-batches", default="1,16,64", help="batches FlexAttention may run at (one per shape)")
    p.add_argument("--flex-compile-cap-s", type=float, default=40.0, help="cap on one FlexAttention compile")
    p.add_argument("--flex-budget-s", type=float, default=60.0, help="FlexAttention compile time, all shapes")
    p.add_argument("--flex-min-s", type=float, default=15.0, help="start a FlexAttention compile only with this left")
    p.add_argument("--flashinfer-reserve-s", type=float, default=15.0, help="late-phase time kept for FlashInfer")
    p.add_argument("--flashinfer-min-s", type=float, default=2.0, help="time one FlashInfer configuration needs")
    p.add_argument("--flashinfer-status", help="flashinfer-prewarm JSON (from gpu_check.sh); compiled here if absent")
    p.add_argument("--flashinfer-jit-cap-s", type=float, default=150.0,
                   help="cap on FlashInfer's JIT when compiled here")
    p.add_argument("--sass-json", help="sass_model.py --json output: the static model's predictions")
    p.add_argument("--probe-json", help="l2_probe.py output, embedded in the result")
    p.add_argument("--check-seqs", type=int, default=2, help="sequences checked against float64 (first and last)")
    p.add_argument("--flush-mb", type=float, default=256.0, help="L2 flush buffer (decimal MB)")
    p.add_argument("--target-ms", type=float, default=20.0, help="timed work per measurement")
    p.add_argument("--max-iters", type=int, default=30)
    p.add_argument("--host-overhead-iters", type=int, default=2000)
    p.add_argument("--cpu-target-s", type=float, default=0.05, help="CPU mode: wall time per measurement")
    p.add_argument("--seed", type=int, default=0)
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    rest = args.rest
    apply_profile(args)
    args.rest = args.rest if rest is None else rest == "on"
    if args.cpu:
        args.baselines = "none"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    env = load_json(args.env_json)
    if env is None:
        env = environment.probe_environment(cpu=args.cpu)
        try:
            env["copy_bandwidth"] = environment.measure_copy_bandwidth(cpu=args.cpu)
        except Exception as err:  # no ratios then, but the times still count
            env["copy_bandwidth"] = {"error": _short(err)}
        env["device_label"] = environment.device_label(env)
    copy = env.get("copy_bandwidth", {})
    result = {
        "schema": "metrale-attn-bench/2",
        "mode": "cpu" if args.cpu else "gpu",
        "profile": args.profile,
        "timing_note": ("CPU backend simulator; not kernel performance" if args.cpu else
                        "median of CUDA-event-timed CUDA-graph launches on one stream, L2 flushed before each"),
        "created_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device_label": env.get("device_label") or environment.device_label(env),
        "environment": {k: v for k, v in env.items() if k != "copy_bandwidth"},
        "copy_bandwidth": copy,
        "copy_tb_per_s": copy.get("tb_per_s"),
        "args": vars(args),
        "rows": [], "skipped": [], "not_measured": [], "host_overhead": [], "baselines": {}, "compile_s": {},
        "budget": {"time_budget_s": args.time_budget_s, "stopped_early": False},
    }
    probe = load_json(args.probe_json)
    if probe is not None:
        result["l2_probe"] = probe
    if args.cpu:
        for name in BASELINE_NAMES:
            result["baselines"][name] = {"status": "not run", "reason": "CPU backend smoke run: no baselines"}
    stem = args.stem or report.default_stem(result)

    def write(plots: bool) -> list[str]:
        if sweep is not None and sweep.flashinfer_status is not None:
            result["flashinfer_prewarm"] = sweep.flashinfer_status
        result["budget"]["elapsed_s"] = round(time.monotonic() - t0, 1)
        summarize_baselines(result)
        result["targets"] = report.evaluate_targets(result)
        return report.write_outputs(result, args.out_dir, stem, plots=plots)

    signal.signal(signal.SIGTERM, _on_sigterm)
    sweep = None
    aborted = False
    try:
        sweep = CpuSweep(args, result) if args.cpu else GpuSweep(args, result)
        sweep.on_checkpoint = lambda: write(plots=False)
        sweep.run()
    except (Exception, Terminated) as err:  # write what was measured, and why it stopped
        traceback.print_exc()
        aborted = True
        if sweep is not None and sweep.pending:
            _not_measured(result, sweep.pending, f"sweep aborted: {_short(err, 120)}")
        result["budget"].update(stopped_early=True, reason=f"sweep aborted: {_short(err)}")
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM now ends the process: the caller's cap
        write(plots=False)  # the numbers first: drawing the plots takes seconds a cap may not leave
        for path in write(plots=True):
            print(f"wrote {path}")
        print(report.targets_table(result["targets"]))
    return 1 if aborted else 0  # 1: cut short by an error or SIGTERM (what was measured is written)


if __name__ == "__main__":
    sys.exit(main())
