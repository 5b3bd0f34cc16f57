"""The check's orchestration: compile, one worker process per implementation, the report.

``run_check`` is what ``metrale-attn check`` does, in order:

1. **Compile** (GPU): every kernel the cells need for this device, through NVRTC into the
   package's cubin cache, ``jobs`` at a time in processes of their own, so the workers find
   them all (a hit each). The CPU backend builds its modules in the worker.
2. **One worker per implementation** (``worker.py``), ours first (``mma``, then ``simt``), then
   the peers, each capped at ``cap_s`` seconds. A worker's events stream into
   ``events_<impl>.jsonl`` in the output folder and are printed as they come. A worker that
   ends on a sticky CUDA error, dies, or passes its cap is recorded as a fault naming the
   implementation, the cell it was running and the error; its cells that never ran are
   ``not run``; the next implementation starts in a fresh process.
3. **The report** (``report.py``) from every events file in the folder: a later call that
   runs other implementations into the same folder (the GPU check runs FlashInfer late) adds
   its own, and the report covers both.

The exit code is 0 when every cell of ours that ran passed and no worker of ours faulted; 1
otherwise. A peer that is unavailable or wrong is reported, and fails nothing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Optional, Sequence

from ..precompile import Layer, Options, TargetPlan, build_all, needed_specs, target_for_arch
from . import report as reporting
from .cells import ARM_OPTIONS, IMPLS, KV_DTYPES, OURS, POINTS, Cell, Named, mma_runs_simt, plan_cells

WORKER = (sys.executable, "-m", "metrale_attn.check.worker")


@dataclass(frozen=True)
class CheckOptions:
    """What one check runs. ``layers``: one rank's layer kinds; ``model``: their label in the
    report; ``impls``: ours and the peers (``cells.IMPLS``), run in ``IMPLS`` order; ``backend``:
    ``auto`` (the GPU where CuPy sees one, else the CPU), ``cupy`` or ``cpu``; ``cap_s``: each
    worker's wall-clock cap; ``jobs``: compile processes; ``correctness``/``timed``: which halves
    run (``timed`` None: wherever there is a GPU); ``named``: cells beyond the grid of ``layers`` x
    ``kv_dtypes`` x ``points`` (``--cells``; ``layers`` may then be empty)."""

    layers: tuple[Layer, ...]
    model: str
    out_dir: Path
    kv_dtypes: tuple[str, ...] = ("bf16",)
    impls: tuple[str, ...] = ("mma", "sdpa", "flashinfer")
    points: tuple[tuple[int, int], ...] = POINTS
    backend: str = "auto"
    cap_s: float = 300.0
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)
    correctness: bool = True
    timed: Optional[bool] = None
    seed: int = 0
    copy_gib: float = 2.0
    check_seqs: int = 2
    deadline_s: Optional[float] = None
    """All workers together end within this many seconds of the first's start: each gets the time
    left shared among those still to run (at most ``cap_s``), so the first is never starved."""
    flashinfer_status: Optional[str] = None
    """A FlashInfer JIT prewarm's status file (the benchmark harness builds FlashInfer's kernels ahead):
    a FlashInfer cell whose kernel it did not build is unavailable rather than compiled in the cell."""
    worker: tuple[str, ...] = WORKER
    """The worker's command line before its two arguments (the check's tests substitute a double)."""
    named: tuple[Named, ...] = ()

    def __post_init__(self):
        if not self.layers and not self.named:
            raise ValueError("a check needs at least one layer (--model, --hf-config or --cells)")
        for name, values, known in (("--kv-dtype", self.kv_dtypes, KV_DTYPES), ("--impl", self.impls, IMPLS)):
            bad = [v for v in values if v not in known]
            if bad or not values:
                raise ValueError(f"{name} takes {', '.join(known)}; got {', '.join(values) or 'nothing'}")
        if self.backend not in ("auto", "cupy", "cpu"):
            raise ValueError(f"--backend takes auto, cupy or cpu; got {self.backend!r}")
        for name, value in (("jobs", self.jobs), ("check_seqs", self.check_seqs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        for name, value in (("cap_s", self.cap_s), ("deadline_s", self.deadline_s), ("copy_gib", self.copy_gib)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def resolve_backend(name: str) -> str:
    """``auto`` -> ``cupy`` where CuPy sees a device, else ``cpu`` (no CUDA context is made here)."""
    if name != "auto":
        return name
    from ..backends import cuda_available

    return "cupy" if cuda_available() else "cpu"


def run_check(options: CheckOptions, say: Callable[[str], None] = print) -> tuple[int, dict]:
    """Run the check (see the module's docstring); returns (exit code, the report as written)."""
    t0 = time.monotonic()
    elapsed = lambda: time.monotonic() - t0  # noqa: E731
    out = Path(options.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    backend = resolve_backend(options.backend)
    timed = (backend == "cupy") if options.timed is None else options.timed
    cells = plan_cells(options.layers, options.kv_dtypes, options.impls, timed=timed, correctness=options.correctness,
                       points=options.points, named=options.named)
    named = f" and {len(options.named)} named cell(s)" if options.named else ""
    say(f"[check {elapsed():.0f}s] {options.model}: {len(options.layers)} layer kind(s), KV "
        f"{', '.join(options.kv_dtypes)}{named}, {len(cells)} cells on the {backend} backend"
        + ("" if timed else "; no timing (no GPU)"))
    if backend == "cupy":
        compile_kernels(options, say=lambda line: say(f"[check {elapsed():.0f}s] {line}"))
    todo = [(impl, [c for c in cells if c.impl == impl]) for impl in IMPLS if impl in options.impls]
    todo = [(impl, mine) for impl, mine in todo if mine]
    workers_t0 = time.monotonic()
    for n, (impl, mine) in enumerate(todo):
        cap = options.cap_s
        if options.deadline_s is not None:
            left = options.deadline_s - (time.monotonic() - workers_t0)
            cap = min(cap, max(left, 1.0) / (len(todo) - n))
        run_worker(impl, mine, options, backend, out, cap, say=lambda line: say(f"[check {elapsed():.0f}s] {line}"))
    layers = list(dict.fromkeys([*options.layers, *(n.layer for n in options.named)]))
    meta = dict(model=options.model, layers=[vars(layer) for layer in layers], backend=backend, timed=timed,
                kv_dtypes=list(options.kv_dtypes), points=[list(p) for p in options.points],
                named=[f"{Cell('time', '', n.layer, n.kv_dtype, batch=n.batch, context=n.context).label.strip()}"
                       for n in options.named],
                seconds=round(elapsed(), 1))
    result = reporting.build(reporting.read_events(out), meta)
    written = reporting.write(result, out)
    for line in reporting.short_table(result):
        say(line)
    say(f"wrote {', '.join(str(p) for p in written)}")
    return (0 if result["verdict"] == "ok" else 1), result


# -- compiling ------------------------------------------------------------------------------


def _device_arch() -> tuple[str, int]:
    import cupy

    dev = cupy.cuda.Device()
    major, minor = dev.compute_capability[:-1], dev.compute_capability[-1]
    return f"sm_{major}{minor}", int(cupy.cuda.runtime.getDeviceProperties(dev.id)["multiProcessorCount"])


def kernel_plans(options: CheckOptions, arch: str, sm_count: int) -> list[TargetPlan]:
    """One single-kernel ``TargetPlan`` per kernel the cells need on ``arch`` (pure): every arm of
    every one of our implementations, each KV dtype (and each named cell's layer at its own),
    deduplicated by name."""
    target = target_for_arch(arch)
    found: dict = {}
    pairs = list(dict.fromkeys([(layer, kv) for layer in options.layers for kv in options.kv_dtypes]
                               + [(n.layer, n.kv_dtype) for n in options.named]))
    for impl in (i for i in OURS if i in options.impls):
        for kv in dict.fromkeys(kv for _, kv in pairs):
            for arm in ARM_OPTIONS.values():
                base = Options(kv_dtype="fp8_e4m3" if kv == "fp8" else "bfloat16", impl=impl, max_batch=64, **arm)
                for layer in (layer for layer, k in pairs if k == kv):
                    # An mma cell of a shape only simt serves constructs with the default impl (the worker's
                    # impl_argument), which compiles simt's kernels there.
                    asked = replace(base, impl=None) if impl == "mma" and mma_runs_simt(layer) else base
                    try:
                        plan = needed_specs([layer], target, asked, sm_count=sm_count)
                    except ValueError:
                        continue  # the worker constructs the same layer and reports the refusal
                    for needed in plan.needed:
                        found.setdefault(needed.name, replace(plan, needed=(needed,)))
    return list(found.values())


def compile_kernels(options: CheckOptions, say: Callable[[str], None]) -> None:
    """Every kernel the cells need, ``options.jobs`` NVRTC compiles at a time
    (``precompile.build_all``), into the cache the workers read. A failure here is only said:
    the worker that needs the kernel meets it again and reports it as its cell's result."""
    arch, sm_count = _device_arch()
    plans = kernel_plans(options, arch, sm_count)
    t0 = time.monotonic()
    say(f"compiling {len(plans)} kernels for {arch} ({min(options.jobs, len(plans)) or 1} processes; cached ones are "
        "hits)")
    built = build_all(plans, jobs=options.jobs, keep_going=True)
    for failed in (b for b in built if b.error):
        say(f"{failed.name}: {failed.error[:300]} (the cell that needs it will say so)")
    misses = sum(not b.hit and not b.error for b in built)
    failed = sum(bool(b.error) for b in built)
    say(f"compiled {misses} kernels ({len(plans) - misses - failed} were cached, {failed} failed) in "
        f"{time.monotonic() - t0:.1f} s")


# -- workers --------------------------------------------------------------------------------


def run_worker(impl: str, cells: Sequence[Cell], options: CheckOptions, backend: str, out: Path, cap_s: float,
               say: Callable[[str], None]) -> dict:
    """Run ``impl``'s cells in a process of their own (see the module's docstring); returns the
    fault record written, or an empty dict when the worker ended by itself with no fault."""
    events = out / f"events_{impl}.jsonl"
    job = out / f"job_{impl}.json"
    events.unlink(missing_ok=True)
    job.write_text(json.dumps(dict(impl=impl, backend=backend, cells=[c.to_json() for c in cells], seed=options.seed,
                                   copy_gib=options.copy_gib, check_seqs=options.check_seqs,
                                   flashinfer_status=options.flashinfer_status)))
    stderr_path = out / f"worker_{impl}.log"
    say(f"{impl}: {len(cells)} cells in a process of its own (cap {cap_s:.0f} s)")
    t0 = time.monotonic()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen([*options.worker, str(job), str(events)], stdin=subprocess.DEVNULL,
                                stdout=stderr, stderr=stderr)
        seen = 0
        timed_out = False
        while proc.poll() is None:
            time.sleep(0.2)
            seen = _echo(events, seen, say)
            if time.monotonic() - t0 > cap_s:
                proc.kill()
                proc.wait()
                timed_out = True
        seen = _echo(events, seen, say)
    job.unlink(missing_ok=True)
    rc = proc.returncode
    lines = reporting.read_jsonl(events)
    if any(e["event"] == "fault" for e in lines):
        fault = next(e for e in lines if e["event"] == "fault")
        say(f"{impl}: FAULT in {fault['cell']}: {fault['error'][:200]} (the process ended; the next implementation "
            "starts fresh)")
        return fault
    if rc == 0 and not timed_out:
        return {}
    running = reporting.running_cell(lines)
    tail = stderr_path.read_text(errors="replace")[-1500:] if stderr_path.exists() else ""
    error = (f"passed its cap of {cap_s:.0f} s" if timed_out else
             f"the worker died (exit {rc}{', signal ' + str(-rc) if rc < 0 else ''}): "
             f"{tail.strip().splitlines()[-1] if tail.strip() else 'no message'}")
    fault = dict(event="fault", impl=impl, cell=running or "(before its first cell)", error=error[:600],
                 traceback=tail, t=round(time.time(), 3))
    with open(events, "a") as f:
        f.write(json.dumps(fault) + "\n")
    say(f"{impl}: FAULT in {fault['cell']}: {error[:200]}")
    return fault


def _echo(events: Path, seen: int, say: Callable[[str], None]) -> int:
    """Say each complete result line of ``events`` past byte ``seen`` (the file is read from there,
    not again from its start every poll); returns the byte offset read up to."""
    try:
        with open(events, "rb") as f:
            f.seek(seen)
            chunk = f.read()
    except OSError:
        return seen
    complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next poll
    for line in complete.decode(errors="replace").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e["event"] == "result":
            say(reporting.result_line(e))
        elif e["event"] == "copy":
            say(f"{e['impl']}: copy bandwidth {e['tb_per_s']:.3f} TB/s in this process")
    return seen + len(complete)
