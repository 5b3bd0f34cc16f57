"""Host overhead of ``DecodeAttention.run``: microseconds of Python per call, kernels stubbed.

What a serving loop pays per layer per decode step in eager mode (32-80 calls a step),
without the kernels: a backend whose launch does nothing and which, like the CuPy
backend, does not copy the index arrays to the host (``always_check_indices`` False),
so what is timed is validation, planning and building the launch arguments. Shape:
Llama-3-8B (32 q heads, 8 KV heads, head_dim 128), batch 64, page size 16, bf16 q,
fp8 KV with per-tensor scales, ``out`` and ``lse`` given. Each call is timed on its
own (``time.perf_counter_ns``) and the median of ``--calls`` calls (after 200 warm-up
calls) is printed per case:

- ``numpy, same buffers``: the same arrays every call (a decode step's steady state);
- ``numpy, new q/out``: q and out alternate between two buffers each (other arrays the
  same), so every call sees a q and an out at addresses the last call did not use;
- ``torch, same buffers`` and ``torch, new q/out``: the same with torch CPU tensors;
- ``torch, new q/out views``: new tensor objects for q and out every call, at the
  previous call's addresses, as an eager loop's caching allocator hands them out;
- ``torch op, same buffers``: through ``torch.ops.metrale_attn.paged_decode``
  (the dispatcher's cost included).

    python -m benchmarks.host_overhead [--calls 5000]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from metrale_attn import DecodeAttention, problems
from metrale_attn.backends.cpu_backend import CpuBackend

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16)
BATCH, PAGES_PER_SEQ = 64, 4


class StubLaunches(CpuBackend):
    """The CPU backend with every launch a no-op and no host-side index check: nothing is
    compiled, nothing runs, only ``run``'s own Python is timed."""

    always_check_indices = False

    def load(self, spec):
        class NoOp:
            def launch(self, launch):
                pass

        return NoOp()


def build():
    attn = DecodeAttention(SHAPE["num_q_heads"], SHAPE["num_kv_heads"], SHAPE["head_dim"], SHAPE["page_size"],
                           q_dtype="bfloat16", kv_dtype="fp8_e4m3", max_batch=BATCH, backend=StubLaunches())
    p = problems.make_problem(np.random.default_rng(0), num_seqs=BATCH, num_q_heads=SHAPE["num_q_heads"],
                               num_kv_heads=SHAPE["num_kv_heads"], head_dim=SHAPE["head_dim"],
                               page_size=SHAPE["page_size"], seq_lens=[PAGES_PER_SEQ * SHAPE["page_size"]] * BATCH,
                               kv_dtype="fp8", q_dtype="bf16", layout="NHD")
    return attn, p


def median_us(call, calls: int) -> float:
    for _ in range(200):
        call()
    samples = []
    clock = time.perf_counter_ns
    for _ in range(calls):
        t0 = clock()
        call()
        samples.append(clock() - t0)
    return statistics.median(samples) / 1e3


def cases(attn, p):
    out = np.empty_like(p.q)
    lse = np.empty(p.q.shape[:2], np.float32)
    args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
    kw = dict(k_scale=p.k_scale, v_scale=p.v_scale)
    yield "numpy, same buffers", lambda: attn.run(*args, out=out, lse=lse, **kw)
    qs = [p.q.copy() for _ in range(2)]
    outs = [np.empty_like(p.q) for _ in range(2)]
    step = iter(range(1 << 62))

    def fresh():  # alternating objects and addresses: every call sees a q and an out it did not see last
        i = next(step) & 1
        attn.run(qs[i], *args[1:], out=outs[i], lse=lse, **kw)

    yield "numpy, new q/out", fresh
    try:
        import torch
    except ImportError:
        return
    t = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == p.q.dtype else
         torch.from_numpy(a.view(np.uint8)).view(torch.float8_e4m3fn) if a.dtype.itemsize == 1 else
         torch.from_numpy(a) for a in args]  # views: no copies
    tout, tlse = torch.empty_like(t[0]), torch.empty(tuple(p.q.shape[:2]), dtype=torch.float32)
    yield "torch, same buffers", lambda: attn.run(*t, out=tout, lse=tlse, **kw)
    tqs = [t[0].clone() for _ in range(2)]
    touts = [torch.empty_like(t[0]) for _ in range(2)]

    def torch_fresh():
        i = next(step) & 1
        attn.run(tqs[i], *t[1:], out=touts[i], lse=tlse, **kw)

    yield "torch, new q/out", torch_fresh
    # What an eager loop's caching allocator does: new tensor objects every step, at the
    # addresses the last step's had (torch fingerprints by data pointer, not object).
    yield "torch, new q/out views", lambda: attn.run(t[0][:], *t[1:], out=tout[:], lse=tlse, **kw)
    try:
        from metrale_attn import torch_op  # noqa: F401  (registers the op)
    except ImportError:
        return
    op, handle = torch.ops.metrale_attn.paged_decode, attn.handle
    yield "torch op, same buffers", lambda: op(handle, *t, tout, tlse, p.k_scale, p.v_scale)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args(argv)
    attn, p = build()
    print(f"{platform.processor() or platform.machine()}, Python {platform.python_version()}, "
          f"NumPy {np.__version__}; Llama-3-8B shape, batch {BATCH}, fp8 KV, out and lse given, launches stubbed; "
          f"median of {args.calls} calls")
    for name, call in cases(attn, p):
        print(f"{name:26s} {median_us(call, args.calls):7.1f} us per run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
