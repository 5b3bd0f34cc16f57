"""The split-K merge with and without programmatic dependent launch, side by side: the
same layer built twice (``dependent_launch=True`` / ``False``), the same inputs, the output
bytes compared and each call timed (CUDA graph, L2 flushed, ``timing.GpuTimer``), the two
timings interleaved so drift hits both. The model predicts the gain (``call_model``,
``dependent_launch_gap``); this measures it.

    python -m benchmarks.pdl_check --out pdl.json           on a GPU (the GPU check's step)
    python -m benchmarks.pdl_check --cpu --out pdl.json     the CPU dry run: bytes only, tiny shapes

Exit 1 when the bytes differ or nothing could be timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .timing import GpuTimer, time_host

CALLS = (  # (q heads, kv heads, head dim, kv dtype, batch, context): the bars the merge's launch gap touches
    (32, 8, 128, "bf16", 1, 32768), (64, 8, 128, "bf16", 1, 32768), (32, 8, 128, "fp8", 16, 4096),
    (24, 4, 256, "fp8", 16, 4096), (32, 8, 128, "bf16", 64, 4096))
CPU_CALLS = ((4, 2, 64, "bf16", 2, 700), (4, 1, 128, "fp8", 1, 600))
PAGE_SIZE = 16


def _inputs(call, seed=0):
    """q, the K and V caches, block tables and lengths of ``call`` as NumPy arrays (the CPU backend)."""
    import ml_dtypes

    q_heads, kv_heads, head_dim, kv_dtype, batch, context = call
    rng = np.random.default_rng(seed)
    pages = -(-context // PAGE_SIZE)
    cache = ml_dtypes.float8_e4m3fn if kv_dtype == "fp8" else ml_dtypes.bfloat16
    shape = (batch * pages, PAGE_SIZE, kv_heads, head_dim)
    k, v = (rng.standard_normal(shape, dtype=np.float32).astype(cache) for _ in range(2))
    q = rng.standard_normal((batch, q_heads, head_dim), dtype=np.float32).astype(ml_dtypes.bfloat16)
    tables = rng.permutation(batch * pages).astype(np.int32).reshape(batch, pages)
    return q, k, v, tables, np.full(batch, context, np.int32)


def _torch_inputs(call, seed=0):
    """The same on the GPU as torch tensors (generated there: the 32k calls are GBs)."""
    import torch

    q_heads, kv_heads, head_dim, kv_dtype, batch, context = call
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages = -(-context // PAGE_SIZE)
    shape = (batch * pages, PAGE_SIZE, kv_heads, head_dim)
    cache = torch.float8_e4m3fn if kv_dtype == "fp8" else torch.bfloat16
    k, v = (torch.randn(shape, device="cuda", generator=gen).to(cache) for _ in range(2))
    q = torch.randn((batch, q_heads, head_dim), device="cuda", generator=gen).to(torch.bfloat16)
    tables = torch.randperm(batch * pages, device="cuda", generator=gen).to(torch.int32).reshape(batch, pages)
    return q, k, v, tables, torch.full((batch,), context, dtype=torch.int32, device="cuda")


def check(call, backend: str, timer=None) -> dict:
    """One call both ways: bytes equal, microseconds each (median), and their ratio."""
    from metrale_attn import DecodeAttention

    q_heads, kv_heads, head_dim, kv_dtype, batch, context = call
    row = {"call": f"{q_heads}/{kv_heads}/{head_dim} {kv_dtype} b{batch} x {context}"}
    attns = {on: DecodeAttention(q_heads, kv_heads, head_dim, PAGE_SIZE, q_dtype="bf16", kv_dtype=kv_dtype,
                                 max_batch=batch, backend=backend, dependent_launch=on) for on in (True, False)}
    if backend == "cpu":
        args = _inputs(call)
        outs = {on: attn.run(*args) for on, attn in attns.items()}
        row["bytes_equal"] = outs[True].tobytes() == outs[False].tobytes()
        row.update({f"us_{'pdl' if on else 'plain'}": time_host(lambda a=attn: a.run(*args), max_iters=3).median_us
                    for on, attn in attns.items()})
        return row
    import torch

    args = _torch_inputs(call)
    timer.synchronize_device()
    outs = {on: torch.empty_like(args[0]) for on in (True, False)}
    launches = {}
    for on, attn in attns.items():
        launches[on] = timer.capture_cupy(lambda a=attn, o=outs[on]: a.run(*args, out=o))
        launches[on]()
    timer.synchronize_device()
    row["bytes_equal"] = bool(torch.equal(outs[True].view(torch.int16), outs[False].view(torch.int16)))
    samples = {True: [], False: []}
    for _ in range(3):  # interleaved rounds
        for on in (True, False):
            samples[on].append(timer.measure(launches[on]).median_us)
    for on in (True, False):
        row[f"us_{'pdl' if on else 'plain'}"] = float(np.median(samples[on]))
    row["plain_over_pdl"] = round(row["us_plain"] / row["us_pdl"], 4)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="the CPU backend, tiny shapes, bytes only")
    parser.add_argument("--out", default="pdl_check.json")
    args = parser.parse_args(argv)
    backend = "cpu" if args.cpu else "cupy"
    timer = None if args.cpu else GpuTimer()
    rows, t0 = [], time.monotonic()
    for call in CPU_CALLS if args.cpu else CALLS:
        try:
            rows.append(check(call, backend, timer))
        except Exception as err:  # one call's failure is a row, not the end of the step
            rows.append({"call": str(call), "error": f"{type(err).__name__}: {err}"[:400]})
        print(json.dumps(rows[-1]), flush=True)
    result = {"backend": backend, "seconds": round(time.monotonic() - t0, 1), "rows": rows}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    ok = rows and all(r.get("bytes_equal") for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
