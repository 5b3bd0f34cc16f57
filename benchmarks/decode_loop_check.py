"""gpu_check.sh's end-to-end step: the serving loop the vLLM backend shares, on the device.

vLLM cannot be installed on the device machine, so the end-to-end proof there is
``examples/decode_loop.py``: a multi-layer model whose decode tokens go through
``metrale_attn.serving.ModelAttention`` and the op ``torch.ops.metrale_attn.paged_decode``,
the very objects, workspace and op the vLLM backend decodes with. Runs, each in its own
process under a cap, one line printed as each ends:

1. correctness: eager, compiled (inductor), compiled + CUDA graph (the default small model),
   and Llama-3-8B's attention shape (32/8/128) under a CUDA graph; every attention output of
   every layer and step against the float64 reference (1 ulp of bf16);
2. speed: a decode step of the loop at batch 64 with 4k-token sequences (32/8/128, 2 layers,
   compiled + CUDA graph), median of N replays, on our kernels and on PyTorch SDPA over the
   gathered KV (the same loop, ``--attention sdpa``).

``--cpu``: the dry run CI makes (CPU backend, tiny shapes, eager only, no CUDA graph; the
timings are the simulator's, not kernel performance). Writes ``--out`` (JSON) as each run ends; prints
``STATUS<TAB>DETAIL`` last for the step table; exit 0 unless a correctness run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOOP = os.path.join(REPO, "examples", "decode_loop.py")
LLAMA_8B = ["--q-heads", "32", "--kv-heads", "8", "--head-dim", "128"]
TIMED_GPU = LLAMA_8B + ["--layers", "2", "--bucket", "64", "--pages", str(64 * 258 + 8), "--min-prompt", "4000",
                        "--max-len", "4096", "--join", "1", "--steps", "2", "--no-check", "--compile",
                        "--cuda-graph"]
TIMED_CPU = ["--bucket", "4", "--min-prompt", "40", "--max-len", "90", "--join", "1", "--steps", "2", "--no-check"]

RUNS = {
    "gpu": [
        ("eager", "check", ["--device", "cuda"]),
        ("compiled", "check", ["--device", "cuda", "--compile"]),
        ("cuda-graph", "check", ["--device", "cuda", "--compile", "--cuda-graph"]),
        ("llama-3-8b cuda-graph", "check", ["--device", "cuda", "--compile", "--cuda-graph", *LLAMA_8B, "--bucket",
                                            "8", "--pages", "64", "--steps", "8"]),
        ("metrale b64 x 4k", "time", ["--device", "cuda", *TIMED_GPU]),
        ("sdpa b64 x 4k", "time", ["--device", "cuda", *TIMED_GPU, "--attention", "sdpa"]),
    ],
    "cpu": [  # torch.compile of the loop is CI's already (tests/test_examples.py)
        ("eager", "check", []),
        ("metrale b4 (simulator)", "time", TIMED_CPU),
        ("sdpa b4", "time", [*TIMED_CPU, "--attention", "sdpa"]),
    ],
}

_SUMMARY = re.compile(r"(\d+) attention outputs checked, worst (\d+) ulp")
_STEP = re.compile(r"step time .*: ([0-9.]+) ms")


def run_one(name: str, kind: str, argv: list[str], *, timeout_s: float, iters: int) -> dict:
    """One run of the loop in a fresh process; its verdict and numbers."""
    args = [sys.executable, LOOP, *argv] + (["--time", str(iters)] if kind == "time" else [])
    t0 = time.monotonic()
    try:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s, cwd=REPO)
    except subprocess.TimeoutExpired as err:
        out = (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else (err.stdout or "")
        return dict(name=name, kind=kind, status="TIMEOUT", seconds=round(time.monotonic() - t0, 1),
                    detail=f"over {timeout_s:.0f}s", tail=out[-2000:])
    text = done.stdout + done.stderr
    row = dict(name=name, kind=kind, argv=argv, seconds=round(time.monotonic() - t0, 1), rc=done.returncode)
    checked, step = _SUMMARY.search(text), _STEP.search(text)
    if done.returncode != 0:
        last = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return dict(row, status="FAIL", detail=last[0][-200:], tail=text[-3000:])
    if kind == "check":
        row.update(status="ok", checked=int(checked.group(1)), worst_ulp=int(checked.group(2)),
                   detail=f"{checked.group(1)} outputs checked, worst {checked.group(2)} ulp")
    else:
        row.update(status="ok", step_ms=float(step.group(1)), detail=f"{float(step.group(1)):.3f} ms/step")
    return row


def verdict(rows: list[dict]) -> tuple[str, str]:
    """``(status, detail)`` of the step: FAIL when a correctness run did not pass, PARTIAL
    when a timed run did not; the detail names every run and the speed ratio."""
    checks = [r for r in rows if r["kind"] == "check"]
    timed = {r["name"].split()[0]: r for r in rows if r["kind"] == "time"}
    parts = [f"{r['name']} {r['status']}" for r in checks]
    ours, sdpa = timed.get("metrale"), timed.get("sdpa")
    if ours and sdpa and ours.get("step_ms") and sdpa.get("step_ms"):
        parts.append(f"step: ours {ours['step_ms']:.3f} ms, SDPA {sdpa['step_ms']:.3f} ms "
                     f"({sdpa['step_ms'] / ours['step_ms']:.2f}x)")
    else:
        parts += [f"{r['name']} {r['status']}" for r in timed.values()]
    if not checks or any(r["status"] != "ok" for r in checks):
        return "FAIL", "; ".join(parts)
    if any(r["status"] != "ok" for r in timed.values()) or len(timed) < 2:
        return "PARTIAL", "; ".join(parts)
    return "ok", "; ".join(parts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cpu", action="store_true", help="the dry run on the CPU backend")
    p.add_argument("--out", required=True, help="the JSON written as each run ends")
    p.add_argument("--cap-s", type=float, default=150.0, help="the whole step's time")
    p.add_argument("--iters", type=int, default=30, help="timed replays per timed run")
    args = p.parse_args(argv)
    mode = "cpu" if args.cpu else "gpu"
    deadline = time.monotonic() + args.cap_s
    rows = []
    for name, kind, run_argv in RUNS[mode]:
        left = deadline - time.monotonic()
        if left < 5:
            rows.append(dict(name=name, kind=kind, status="skipped", detail="no time left"))
            continue
        rows.append(run_one(name, kind, run_argv, timeout_s=left, iters=args.iters if not args.cpu else 3))
        print(f"[decode_loop] {name}: {rows[-1]['status']} {rows[-1].get('detail', '')} ({rows[-1].get('seconds', 0)}s)",
              flush=True)
        status, detail = verdict(rows)
        with open(args.out, "w") as f:
            json.dump(dict(mode=mode, status=status, detail=detail, runs=rows), f, indent=1)
    status, detail = verdict(rows)
    print(f"{status}\t{detail}")
    return 1 if status == "FAIL" else 0


if __name__ == "__main__":
    sys.exit(main())
