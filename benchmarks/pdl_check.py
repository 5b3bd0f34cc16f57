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

from metrale_attn.check.data import GpuPool
from metrale_attn.check.timing import GpuTimer, time_host

CALLS = (  # (q heads, kv heads, head dim, kv dtype, batch, context): the bars the merge's launch gap touches
    (32, 8, 128, "bf16", 1, 32768), (64, 8, 128, "bf16", 1, 32768), (32, 8, 128, "fp8", 16, 4096),
    (24, 4, 256, "fp8", 16, 4096), (32, 8, 128, "bf16", 64, 4096))
CPU_CALLS = ((4, 2, 64, "bf16", 2, 700), (4, 1, 128, "fp8", 1, 600))
PAGE_SIZE = 16


def check(call, backend: str, timer=None) -> dict:
    """One call both ways: bytes equal, microseconds each (median), and their ratio. Inputs:
    ``problems.make_problem`` on the CPU, ``data.GpuPool``'s case (the sweep's) on the GPU."""
    from metrale_attn import DecodeAttention
    from metrale_attn.config import ModelShape
    from metrale_attn.problems import make_problem

    q_heads, kv_heads, head_dim, kv_dtype, batch, context = call
    row = {"call": f"{q_heads}/{kv_heads}/{head_dim} {kv_dtype} b{batch} x {context}"}
    attns = {on: DecodeAttention(q_heads, kv_heads, head_dim, PAGE_SIZE, q_dtype="bf16", kv_dtype=kv_dtype,
                                 max_batch=batch, backend=backend, dependent_launch=on) for on in (True, False)}
    if backend == "cpu":
        p = make_problem(np.random.default_rng(0), num_seqs=batch, num_q_heads=q_heads, num_kv_heads=kv_heads,
                         head_dim=head_dim, page_size=PAGE_SIZE, seq_lens=context, kv_dtype=kv_dtype)
        args = (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)
        outs = {on: attn.run(*args, k_scale=p.k_scale, v_scale=p.v_scale) for on, attn in attns.items()}
        row["bytes_equal"] = outs[True].tobytes() == outs[False].tobytes()
        row.update({f"us_{'pdl' if on else 'plain'}": time_host(
            lambda a=attn: a.run(*args, k_scale=p.k_scale, v_scale=p.v_scale), max_iters=3).median_us
            for on, attn in attns.items()})
        return row
    import torch

    pages = -(-context // PAGE_SIZE)
    case = GpuPool(ModelShape(q_heads, kv_heads, head_dim), kv_dtype, PAGE_SIZE, batch * pages, seed=0).case(
        batch, context)
    timer.synchronize_device()
    outs = {on: torch.empty_like(case.q) for on in (True, False)}
    launches = {}
    for on, attn in attns.items():
        launches[on] = timer.capture_cupy(lambda a=attn, o=outs[on]: a.run(
            case.q, case.k_pool, case.v_pool, case.block_tables, case.seq_lens, k_scale=case.k_scale,
            v_scale=case.v_scale, out=o))
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
