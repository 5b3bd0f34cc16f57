"""How a call is timed on a GPU (``metrale-attn check``, the benchmark harness): CUDA graphs, CUDA events, L2 flushed.

This module owns HOW a call is timed, so that every implementation in a run (ours
and the baselines) is timed the same way:

- Everything runs on ONE CUDA stream, created here with CuPy (``GpuTimer.stream``).
  PyTorch work is put on the same stream through ``torch.cuda.ExternalStream``, so
  the events, the L2 flush and the timed launch are ordered on one queue.
- A call is warmed up eagerly first (compilation, allocator growth), then captured
  into a CUDA graph; the timed launch is one graph launch. Ours is captured with
  CuPy's stream capture (``DecodeAttention.run`` with ``out`` given allocates
  nothing and never synchronizes); PyTorch baselines with ``torch.cuda.graph``,
  whose allocator knows about capture. A call that cannot be captured is timed
  eagerly and says so (``Timing.mode``).
- Before every timed launch the L2 is flushed by a ``cudaMemsetAsync`` of a buffer
  of ``flush_bytes`` (default 256 MB; the H200's L2 is 50-60 MB), outside the events.
- Each sample is the elapsed time between an event recorded just before and one
  just after the launch, on the same stream. The result is the MEDIAN in
  microseconds; min and max are kept. The number of samples adapts to the call's
  length (``target_ms`` of timed work, between ``min_iters`` and ``max_iters``).

On the CPU backend there is no stream and no graph: ``time_host`` times a Python
callable with ``time.perf_counter`` (median), for the simulator's smoke run.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

FLUSH_BYTES = 256 * 10**6


@dataclass
class Timing:
    """One timed call: median, min and max microseconds over ``iters`` samples."""

    median_us: float
    min_us: float
    max_us: float
    iters: int
    mode: str  # "cuda-graph", "eager" (with the reason capture failed) or "cpu-wallclock"
    note: str = ""
    samples_us: list = field(default_factory=list)

    def to_json(self) -> dict:
        out = asdict(self)
        out["samples_us"] = [round(s, 3) for s in self.samples_us]
        return out


def _summarize(samples_us: list[float], mode: str, note: str = "") -> Timing:
    return Timing(statistics.median(samples_us), min(samples_us), max(samples_us), len(samples_us), mode, note,
                  samples_us)


def time_host(fn: Callable[[], object], *, min_iters: int = 3, max_iters: int = 20, target_s: float = 0.5) -> Timing:
    """Median wall-clock microseconds of ``fn()`` on the host (CPU backend: the simulator, not a GPU)."""
    t0 = time.perf_counter()
    fn()  # warm-up
    first = time.perf_counter() - t0
    iters = max(min_iters, min(max_iters, int(target_s / max(first, 1e-6))))
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e6)
    return _summarize(samples, "cpu-wallclock", "CPU backend simulator; not kernel performance")


class GpuTimer:
    """Captures and times calls on one CuPy stream with CUDA events, flushing L2 before each sample."""

    def __init__(self, *, flush_bytes: int = FLUSH_BYTES, min_iters: int = 5, max_iters: int = 50,
                 target_ms: float = 30.0, warmup: int = 3):
        import cupy

        self._cupy = cupy
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.flush_bytes = int(flush_bytes)
        self._flush_buf = cupy.empty(self.flush_bytes, dtype=cupy.uint8)
        self.min_iters, self.max_iters, self.target_ms, self.warmup = min_iters, max_iters, target_ms, warmup
        self._torch_stream = None

    # -- streams -----------------------------------------------------------

    def torch_stream(self):
        """This timer's stream as a ``torch.cuda.ExternalStream`` (None without PyTorch)."""
        if self._torch_stream is None:
            try:
                import torch
            except ImportError:
                return None
            self._torch_stream = torch.cuda.ExternalStream(self.stream.ptr)
        return self._torch_stream

    @contextlib.contextmanager
    def on_stream(self):
        """Make this timer's stream current for CuPy and (if present) PyTorch."""
        ts = self.torch_stream()
        with self.stream:
            if ts is None:
                yield
            else:
                import torch

                with torch.cuda.stream(ts):
                    yield

    def synchronize_device(self) -> None:
        """Wait for all work on the device (every stream): used between set-up and timing."""
        self._cupy.cuda.Device().synchronize()

    def flush_l2(self) -> None:
        """Overwrite ``flush_bytes`` on this stream so no input of the next call is left in L2."""
        self._cupy.cuda.runtime.memsetAsync(self._flush_buf.data.ptr, 0, self.flush_bytes, self.stream.ptr)

    # -- capture -----------------------------------------------------------

    def capture_cupy(self, fn: Callable[[], object]) -> Callable[[], None]:
        """Capture ``fn`` (CuPy launches, e.g. ``DecodeAttention.run`` with ``out``) into a CUDA graph;
        returns a function that launches the graph on this timer's stream.

        The stream is made current for CuPy AND PyTorch (``on_stream``): ``run`` given torch
        tensors launches on torch's current stream, and outside ``on_stream`` that is torch's
        default (legacy) stream, which is not the capturing one: the kernels would run eagerly
        there (or fail), and the graph would come back empty."""
        stream = self.stream
        self.synchronize_device()
        with self.on_stream():
            stream.begin_capture()
            try:
                fn()
            finally:
                graph = stream.end_capture()
        return lambda: graph.launch(stream)

    def capture_poisoned(self, call: Callable[[], object], out, *, warmup: int = 2) -> Callable[[], None]:
        """Warm ``call`` up on this stream, capture it (``capture_cupy``), fill ``out`` (a torch tensor)
        with NaN and launch the graph once; returns the launch. ``out`` then holds what the graph
        wrote, for the check before timing: an element it never wrote is still NaN."""
        self.synchronize_device()
        with self.on_stream():  # warm-up outside capture
            for _ in range(warmup):
                call()
        launch = self.capture_cupy(call)
        out.fill_(float("nan"))
        self.synchronize_device()
        with self.on_stream():
            launch()
        self.synchronize_device()
        return launch

    def capture_torch(self, fn: Callable[[], object]):
        """Capture ``fn`` (PyTorch ops) with ``torch.cuda.graph``; returns ``(launch, output)``.

        The graph is replayed on this timer's stream (PyTorch's current stream inside
        ``on_stream``); its memory comes from the graph's private pool.
        """
        import torch

        self.synchronize_device()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            output = fn()
        self.synchronize_device()
        return graph.replay, output

    # -- timing ------------------------------------------------------------

    def measure(self, launch: Callable[[], object], *, mode: str = "cuda-graph", note: str = "") -> Timing:
        """Median microseconds of ``launch()`` between two events on this stream, L2 flushed before each."""
        cupy, stream = self._cupy, self.stream
        self.synchronize_device()
        with self.on_stream():
            for _ in range(self.warmup):
                self.flush_l2()
                launch()
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            self.flush_l2()
            start.record(stream)
            launch()
            end.record(stream)
            end.synchronize()
            estimate_ms = max(cupy.cuda.get_elapsed_time(start, end), 1e-3)
            iters = max(self.min_iters, min(self.max_iters, math.ceil(self.target_ms / estimate_ms)))
            starts = [cupy.cuda.Event() for _ in range(iters)]
            ends = [cupy.cuda.Event() for _ in range(iters)]
            for i in range(iters):
                self.flush_l2()
                starts[i].record(stream)
                launch()
                ends[i].record(stream)
            ends[-1].synchronize()
        samples_us = [cupy.cuda.get_elapsed_time(a, b) * 1e3 for a, b in zip(starts, ends)]
        return _summarize(samples_us, mode, note)

    def host_overhead_us(self, call: Callable[[], object], *, iters: int = 2000) -> float:
        """Wall-clock microseconds of Python per ``call()`` on this stream, no synchronization inside
        the loop (only one at the end, outside the clock). Meaningful when the GPU work per call is
        shorter than the host's, so the launch queue never fills."""
        self.synchronize_device()
        with self.on_stream():
            call()
            self.stream.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                call()
            elapsed = time.perf_counter() - t0
            self.stream.synchronize()
        return elapsed / iters * 1e6


def try_capture_torch(timer: GpuTimer, fn: Callable[[], object]) -> tuple[Callable[[], object], str, str, object]:
    """Capture ``fn`` with PyTorch; on failure fall back to eager launches.

    Returns ``(launch, mode, note, output)``: ``mode`` is ``"cuda-graph"`` or
    ``"eager"``, and ``note`` says why capture failed.
    """
    try:
        launch, output = timer.capture_torch(fn)
        return launch, "cuda-graph", "", output
    except Exception as err:  # some library calls cannot be captured: time them eagerly and say so
        try:
            import torch

            torch.cuda.synchronize()
        except Exception:
            pass
        return fn, "eager", f"CUDA graph capture failed ({type(err).__name__}: {str(err)[:200]}); timed eagerly", None


def gpu_free_bytes() -> Optional[int]:
    """Free device memory in bytes (None if unknown)."""
    try:
        import cupy

        free, _total = cupy.cuda.runtime.memGetInfo()
        return int(free)
    except Exception:
        return None
