"""Stand-ins for ``metrale-attn check``'s worker process (``metrale_attn.check.worker``), to prove
what the check does when a kernel is wrong or faults, and to run its GPU timing path on the CPU.

Run as the worker's command line: ``python tests/support/check_doubles.py MODE ARG JOB OUT``.

- ``wrong IMPL``: IMPL's outputs have one element moved far off (a wrong kernel, as the check
  sees it): each of its cells must fail, named.
- ``sticky IMPL``: IMPL's first cell raises what CuPy raises on an illegal address (a sticky
  CUDA error, on a worker that believes it is on a GPU): the worker must end, the fault named.
- ``fallback -``: every construction builds simt whatever it asks (a device that failed the mma
  self-test, as ``DecodeAttention`` answers one): mma cells must fail as ``FALLBACK``.
- ``fake-gpu IMPL``: the timing half on the CPU (IMPL's outputs wrong as above; ``-``: none): ``DecodeAttention`` on the CPU backend fed torch
  CPU tensors, a wall-clock timer for CUDA events and graphs, the pool on the host, the copy
  bandwidth of host memory. Its numbers mean nothing; that every step of the path runs does.
"""

from __future__ import annotations

import contextlib
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere: the checkout's package

import numpy as np  # noqa: E402

from metrale_attn.check import worker  # noqa: E402


class CUDARuntimeError(RuntimeError):
    """The name and text CuPy gives an illegal address."""


class Wrong(worker.Worker):
    target = ""

    def perturbed(self, cell, got):
        if cell.impl != self.target:
            return got
        if hasattr(got, "clone"):  # a torch tensor (the timing path)
            got = got.clone()
            got.view(-1)[0] = float(got.view(-1)[0]) + 1000.0
            return got
        got = np.array(got)
        got.reshape(-1)[0] = np.asarray(got.reshape(-1)[0].astype(np.float32) + 1000.0).astype(got.dtype)
        return got


class Sticky(worker.Worker):
    target = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpu = self.impl == self.target  # only a worker on a GPU treats an error as sticky

    def _device(self):
        return {"name": "CPU backend standing in for a GPU (check_doubles.py sticky)"}

    def correct(self, cell):
        if cell.impl == self.target:
            raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")
        return super().correct(cell)


class FakeGpu(Wrong):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gpu = True

    def _device(self):
        return {"name": "CPU backend standing in for a GPU (check_doubles.py fake-gpu)", "sm_count": 132}


def fake_gpu_patches() -> None:
    """Point the worker's device side at the host (see the module's docstring)."""
    import torch
    import ml_dtypes

    from metrale_attn import DecodeAttention
    from metrale_attn.check import bandwidth, data, timing

    class FakeTimer(timing.GpuTimer):  # wall clock, no streams, no graphs
        def __init__(self, **kw):
            pass

        def on_stream(self):
            return contextlib.nullcontext()

        def synchronize_device(self):
            pass

        def capture_cupy(self, fn):
            return fn

        def capture_torch(self, fn):
            return fn, fn()

        def measure(self, launch, mode="cuda-graph", note=""):
            samples = []
            for _ in range(3):
                t = time.perf_counter()
                launch()
                samples.append((time.perf_counter() - t) * 1e6)
            return timing._summarize(samples, mode, note)

    def to_numpy(t):
        if t.dtype == torch.bfloat16:
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        if t.dtype == torch.float8_e4m3fn:
            return t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
        return t.numpy()

    class CpuBackedAttention:  # DecodeAttention on the CPU backend, taking and filling torch CPU tensors
        def __init__(self, *args, backend=None, **kwargs):
            self._real = DecodeAttention(*args, backend="cpu", **kwargs)

        def plan(self, n, q_len=1):
            return self._real.plan(n, q_len)

        def run(self, q, k, v, block_tables=None, seq_lens=None, *, out, **kw):
            o = self._real.run(*map(to_numpy, (q, k, v, block_tables, seq_lens)), **kw)
            out.copy_(torch.from_numpy(o.view(np.int16)).view(torch.bfloat16))
            return out

    timing.GpuTimer = FakeTimer
    bandwidth.measure_copy_bandwidth = lambda **kw: bandwidth._copy_cpu(0.01, 3)
    worker.DecodeAttention = CpuBackedAttention
    pool_init = data.GpuPool.__init__
    data.GpuPool.__init__ = lambda self, *a, **kw: pool_init(self, *a, **dict(kw, device="cpu"))


def main(argv: list[str]) -> int:
    mode, target, job, out = argv
    if mode == "wrong":
        cls = type("WrongTarget", (Wrong,), {"target": target})
    elif mode == "sticky":
        cls = type("StickyTarget", (Sticky,), {"target": target})
    elif mode == "fallback":
        from metrale_attn import DecodeAttention

        worker.DecodeAttention = lambda *args, impl=None, **kw: DecodeAttention(*args, impl="simt", **kw)
        cls = worker.Worker
    elif mode == "fake-gpu":
        fake_gpu_patches()
        cls = type("FakeGpuTarget", (FakeGpu,), {"target": target})
    else:
        raise SystemExit(f"check_doubles.py: unknown mode {mode!r}")
    return worker.main([job, out], worker_class=cls)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
