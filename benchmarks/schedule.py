"""The GPU check's schedule: its steps in order, each step's cap and its expected time, and the device
session they must fit. ``gpu_check.sh`` reads its caps from here (``python -m benchmarks.schedule
shell --profile full``) and runs its steps in this order (``benchmarks/tests/test_schedule.py``
checks both), so the plan below is the one the script follows, and a test fails when an edit
pushes the decisive numbers late or the calls past the device session.

Why this order: a device session is short (``SESSION_S``, machine start included) and any call
can be cut off, so the run measures by value. The decisive cells come right after the copy
bandwidth (``DECISIVE_START_S``): the default kernel, the ``simt`` reference and PyTorch SDPA on
every cell of ``DECISIVE`` through ``metrale-attn check``'s own code, each output checked against
float64 before it is timed, then the wide layers' cells ``DECISIVE_CELLS`` (``--cells``: Gemma 4's
global layer, MLA at 16 and 128 heads) on the default kernel and SDPA; their kernels are compiled
beside the environment step. Then the
GPU tests, memcheck, FlashInfer on the same cells (its JIT has built in the background since the
start), the tiers of the sweep (heads per CTA, the features, every forced arm with the earlier
kernels, the grid), the decode loop and the PDL check. racecheck, initcheck, the model probes
(``model_probes.py``: the three inputs the static models disagree on) and the L2 probe wait for
the rerun (``quick``), which also times the decisive cells again.

Estimates (``estimate_s``) are for an H200 and are NOT measured yet (no device has run this
schedule): compile and test times are scaled from this project's 2-core machine, GPU times from
the bytes each call moves. The first device run replaces them with what it measured.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

SESSION_S = 900
"""A device session's time, all calls and the machine's start together."""
MACHINE_START_S = 120
"""A fresh machine's start, at most (1-2 minutes)."""
SPARE_S = 60
"""What the plan leaves unused: a session ends with a minute to spare."""
CALL_TIMEOUT_S = {"full": 480, "quick": 240}
"""The device call's ``timeout_s`` for each profile (benchmarks/README.md gives the calls)."""
DEADLINE_S = {"full": 420, "quick": 200}
"""The script's own deadline: the call's timeout less a margin for the summary, packing and transfer."""
DECISIVE_START_S = 60
"""The decisive cells start within this many seconds of the run's start."""

DECISIVE_MODELS = ("llama-3-8b", "llama-3-70b", "qwen3.8-27b")
DECISIVE_KV = ("bf16", "fp8")
DECISIVE_POINTS = ((64, 4096), (16, 4096), (1, 32768))
DECISIVE = len(DECISIVE_MODELS) * len(DECISIVE_KV) * len(DECISIVE_POINTS)
"""18 cells: 32/8/128, 64/8/128 and 24/4/256, bf16 and fp8, batch 64 and 16 x 4k and batch 1 x 32k."""
DECISIVE_CELLS = (("gemma-4-26b-global", "bf16", (64, 4096)), ("deepseek-v2-lite", "bf16", (64, 4096)),
                  ("deepseek-v3", "bf16", (64, 4096)))
"""The wide layers' cells (``metrale-attn check --cells``), named one by one rather than multiplied into
models x KV x points: Gemma-4-26B-A4B's global layer (16/2/512, V a cache of its own), MLA at 16 heads
(16/1/576/512: DeepSeek-V2-Lite, one rank of DeepSeek-V3 at TP 8; memory-bound, issue 32's goal
>= 85% of copy) and at 128 heads (DeepSeek-V3 at TP 1; compute-bound: the report gives its TFLOP/s),
bf16, batch 64 x 4k. The default kernel runs them on the simt kernels (mma has no kernel of these
shapes), so the ``simt`` worker does not run them again (``check.cells.plan_cells``)."""
DECISIVE_CELLS_CPU = "4/1/576/512:bf16:1x64"
"""The CPU dry run's named cell: MLA's shape at 4 q heads, the same path at a simulator's size."""
DECISIVE_NAMED_IMPLS = ("mma", "sdpa")
"""The implementations that run ``DECISIVE_CELLS``: the default kernel (simt underneath) and SDPA."""
DECISIVE_NAMED_CORRECT_CELLS = 2 * len(DECISIVE_CELLS)
"""Their correctness cells, on the default kernel only: unpacked and split-K a layer, bf16."""
NAMED_CORRECT_CELL_S = 1.0
"""One of those on the device: MLA at 128 heads makes its float64 reference on the host 128 heads x
3,411 tokens x 1,088 dims (0.4 s on this project's 2-core machine), against 0.4 s for a grid's cell."""
DECISIVE_IMPLS = {"full": ("mma", "simt", "sdpa"), "quick": ("mma",)}
WORKER_START_S = 8.0
"""A check worker's start on the device: importing PyTorch and CuPy, the copy bandwidth, the self-test."""
CELL_S = 1.5
"""One decisive timing cell: its pool (once a shape), construction, capture, the float64 check of two
sequences, 5-50 timed replays."""
CORRECT_CELL_S = 0.4
"""One correctness cell on the device (a small problem, the float64 reference on the host)."""
DECISIVE_CORRECT_CELLS = 14
"""The correctness cells of the decisive models for one implementation: 2 + 2 + 3 arms, x 2 KV dtypes."""


def decisive_need_s(profile: str) -> float:
    """What the decisive step needs: a worker per implementation, each its cells (correctness in the
    full profile only), and the named cells on the implementations of ``DECISIVE_NAMED_IMPLS`` asked.
    Full: 3 x (8 + 18 x 1.5) + 2 x 14 x 0.4 + 2 x 3 x 1.5 + 6 x 1.0 = 131.2 s; quick: 8 + 27 + 4.5 = 39.5 s."""
    impls = DECISIVE_IMPLS[profile]
    ours = [i for i in impls if i in ("mma", "simt")]
    named = [i for i in impls if i in DECISIVE_NAMED_IMPLS]
    correct = 0.0
    if profile == "full":
        correct = DECISIVE_CORRECT_CELLS * CORRECT_CELL_S * len(ours)
        correct += DECISIVE_NAMED_CORRECT_CELLS * NAMED_CORRECT_CELL_S * ("mma" in impls)
    return (len(impls) * (WORKER_START_S + DECISIVE * CELL_S) + len(named) * len(DECISIVE_CELLS) * CELL_S
            + correct)


@dataclass(frozen=True)
class Step:
    """One step of the script: its ``name`` in the step table, its ``cap_s`` (a step past it is
    stopped), its expected seconds on an H200 (``estimate_s``, not measured), and ``background``:
    started and left running beside the next steps (its time is not on the run's path)."""

    name: str
    cap_s: int
    estimate_s: float
    background: bool = False


FULL = (
    Step("wheels", 60, 5),
    Step("import", 30, 1),
    Step("flashinfer_jit", 300, 150, background=True),
    Step("compile", 60, 10, background=True),
    Step("environment", 60, 12),
    Step("decisive", 200, decisive_need_s("full")),
    Step("gpu_tests", 100, 80),
    Step("sanitize_memcheck", 45, 20),
    Step("flashinfer", 45, 15),
    Step("benchmark", 0, 0),  # the sweep: whatever the deadline leaves after the reserved steps below
    Step("decode_loop", 90, 70),
    Step("pdl_check", 30, 20),  # 1.5x its estimate: 10 s of its cap went to the decisive wide cells
    Step("summary", 10, 3),
)
QUICK = (
    Step("import", 30, 1),
    Step("compile", 60, 10, background=True),
    Step("environment", 60, 12),
    Step("decisive", 60, decisive_need_s("quick")),
    Step("sanitize_racecheck", 35, 20),
    Step("sanitize_initcheck", 30, 15),
    Step("model_probes", 40, 15),
    Step("l2_probe", 70, 45),
    Step("benchmark", 0, 0),
    Step("summary", 10, 3),
)
PROFILES = {"full": FULL, "quick": QUICK}
RESERVED_AFTER_SWEEP = ("decode_loop", "pdl_check", "summary")
"""Steps after the sweep whose caps the sweep's budget leaves them."""


def steps(profile: str) -> tuple[Step, ...]:
    if profile not in PROFILES:
        raise ValueError(f"--profile takes {', '.join(PROFILES)}; got {profile!r}")
    return PROFILES[profile]


def start_s(profile: str, name: str) -> float:
    """When step ``name`` is expected to start: the estimates of the foreground steps before it (the
    sweep's, its budget)."""
    total = 0.0
    for step in steps(profile):
        if step.name == name:
            return total
        if not step.background:
            total += _sweep_budget(profile, total) if step.name == "benchmark" else step.estimate_s
    raise ValueError(f"{profile} has no step {name!r}")


def _sweep_budget(profile: str, start: float) -> float:
    reserved = sum(s.cap_s for s in steps(profile) if s.name in RESERVED_AFTER_SWEEP)
    return DEADLINE_S[profile] - start - reserved


def sweep_budget_s(profile: str) -> float:
    """The sweep's expected budget: the deadline less the expected start of the sweep and the caps
    reserved for the steps after it (what ``gpu_check.sh`` computes at run time, from the clock)."""
    return _sweep_budget(profile, start_s(profile, "benchmark"))


def session_plan_s() -> int:
    """Device time the documented plan may take: a machine's start, the full call, the rerun."""
    return MACHINE_START_S + CALL_TIMEOUT_S["full"] + CALL_TIMEOUT_S["quick"]


def shell(profile: str) -> str:
    """``CAP_<STEP>=<seconds>`` lines for the script (and ``DEADLINE_S_DEFAULT``)."""
    lines = [f"CAP_{s.name.upper()}={s.cap_s}" for s in steps(profile)]
    lines.append(f"DEADLINE_S_DEFAULT={DEADLINE_S[profile]}")
    lines.append("DECISIVE_MODELS=" + ",".join(DECISIVE_MODELS))
    lines.append("DECISIVE_KV=" + ",".join(DECISIVE_KV))
    lines.append("DECISIVE_POINTS=" + ",".join(f"{b}x{t}" for b, t in DECISIVE_POINTS))
    lines.append("DECISIVE_IMPLS=" + ",".join(DECISIVE_IMPLS[profile]))
    lines.append("DECISIVE_CELLS=" + ",".join(f"{m}:{kv}:{b}x{t}" for m, kv, (b, t) in DECISIVE_CELLS))
    lines.append("DECISIVE_CELLS_CPU=" + DECISIVE_CELLS_CPU)
    return "\n".join(lines)


def table(profile: str) -> str:
    """The schedule as a markdown table (benchmarks/README.md shows it)."""
    out = ["| step | cap (s) | expected start (s) | expected (s, H200, not measured) |", "| --- | --- | --- | --- |"]
    for s in steps(profile):
        start = "beside" if s.background else f"{start_s(profile, s.name):.0f}"
        est = f"{sweep_budget_s(profile):.0f} (the rest)" if s.name == "benchmark" else f"{s.estimate_s:.0f}"
        cap = "budget" if s.name == "benchmark" else str(s.cap_s)
        out.append(f"| `{s.name}` | {cap} | {start} | {est} |")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("shell", "table"))
    parser.add_argument("--profile", default="full", choices=sorted(PROFILES))
    args = parser.parse_args(argv)
    print(shell(args.profile) if args.what == "shell" else table(args.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
