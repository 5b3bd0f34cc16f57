"""The alternatives a user would pick for paged decode, run on the same data as ours.

This module owns the baselines of the sweep (``sweep.py``) and nothing about timing; SDPA and
FlashInfer are defined in ``metrale_attn.check.peers`` (``metrale-attn check`` times them too)
and named here with FlexAttention and FlashInfer's JIT prewarm. Each
``prepare_*`` function takes a ``data.Case`` (one configuration's tensors, already on the
device) and returns a zero-argument callable that computes the decode output
``[num_seqs, num_q_heads, head_dim]`` (bf16) for it, or raises ``Unavailable`` with
the reason it cannot run. The caller warms the callable up, checks its output, then
captures and times it exactly like ours.

- ``sdpa_gather``: ``torch.nn.functional.scaled_dot_product_attention`` after
  gathering each sequence's pages into a contiguous ``[B, KV, T, D]`` tensor (fp8
  dequantized to bf16 in the gather: ``stored * scale``). The gather is INCLUDED in
  the call: this is what a serving stack without a paged kernel pays every step.
- ``sdpa_nogather``: the same SDPA over a tensor gathered once before timing: the
  gather EXCLUDED (an upper bound for dense attention on the same bytes).
- ``flex_paged``: FlexAttention over the paged pool (the physical cache viewed as
  one ``[1, KV, num_pages * page_size, D]`` sequence, block mask and mask_mod
  mapped from logical to physical pages with PyTorch's experimental
  ``PagedAttention`` helper), compiled with ``torch.compile(dynamic=False)`` so
  its decode kernel (static batch) is used. The query group is folded into the
  query-length axis (``[B, KV, G, D]``), which the decode kernel needs for group
  sizes that are not powers of two (6 here). No fp8 K/V.
- ``flashinfer``: ``flashinfer.BatchDecodeWithPagedKVCacheWrapper`` on the same NHD
  pool and page table (CUDA-core decode kernel; the tensor-core path where its
  decode kernel has no instance for the group size, e.g. 6). Its kernels are
  compiled by FlashInfer's JIT (nvcc) on first use, which takes minutes; that
  compile runs ahead of the benchmark in separate processes with a time cap
  (``python -m benchmarks.baselines flashinfer-prewarm``), and the benchmark only
  runs the specs that compiled.

Every baseline works on the CPU too (except FlashInfer), which is how its wiring is
tested without a GPU (``benchmarks/tests/test_benchmarks.py`` does not need PyTorch; a
developer with PyTorch can run ``python -m benchmarks.baselines selftest``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from typing import Callable, Optional

from metrale_attn.check.data import Case
# SDPA and FlashInfer are metrale-attn check's peers too: one definition, there.
from metrale_attn.check.peers import (FLASHINFER_DECODE_GROUP_SIZES, Unavailable, flashinfer_spec,  # noqa: F401
                                      gather_dense, gathered_bytes, prepare_flashinfer, prepare_sdpa_gather,
                                      prepare_sdpa_nogather)

# -- FlexAttention ---------------------------------------------------------------

_FLEX = {}


def _flex_compiled():
    """``torch.compile(flex_attention, dynamic=False)``, once per process.

    Static shapes on purpose: FlexAttention's decode kernel needs a statically known
    batch; with dynamic shapes it falls back to its prefill kernel.
    """
    if "fn" not in _FLEX:
        import torch
        from torch.nn.attention.flex_attention import flex_attention

        for name in ("recompile_limit", "cache_size_limit"):  # one compile per (shape, batch)
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, 256)
                break
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def prepare_flex_paged(case: Case, *, compiled: bool = True) -> Callable[[], object]:
    """FlexAttention over the paged pool through PyTorch's ``PagedAttention`` block-mask conversion."""
    import torch

    if case.kv_dtype != "bf16":
        raise Unavailable("FlexAttention computes q.k in the K/V dtype and takes no fp8 K/V with a bf16 query "
                          "(dequantizing the whole pool first would be a different baseline)")
    try:
        from torch.nn.attention.experimental._paged_attention import PagedAttention
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as err:
        raise Unavailable(f"this PyTorch has no FlexAttention paged attention ({err})") from None

    B, H, D, KV = case.batch, case.num_q_heads, case.head_dim, case.num_kv_heads
    G, page, P = H // KV, case.page_size, case.pages_per_seq
    n_pages = int(case.k_pool.shape[0])
    device = case.q.device

    # The page table of our block_tables, written straight into PagedAttention's tensors
    # (its reserve() allocates pages itself, one sequence at a time).
    paged = PagedAttention(n_pages, page, B, device=str(device))
    table = case.block_tables[:, :P].long()
    paged.page_table[:, :P] = table
    paged.physical_to_logical.scatter_(1, table, torch.arange(P, device=device).expand(B, P).contiguous())
    paged.capacity.fill_(P * page)
    kv_len = case.seq_lens.long()

    def in_sequence(b, h, q_idx, kv_idx):
        return kv_idx < kv_len[b]

    # Query "length" G: the G query heads of a KV head ride along the query axis.
    logical = create_block_mask(in_sequence, B, 1, G, P * page, device=device, BLOCK_SIZE=(128, page))
    physical = paged.convert_logical_block_mask(logical, kv_len=kv_len)
    # NHD [n_pages, page, KV, D] -> [1, KV, n_pages * page, D]: a view (page and token strides merge).
    k = case.k_pool.permute(2, 0, 1, 3).reshape(1, KV, n_pages * page, D)
    v = case.v_pool.permute(2, 0, 1, 3).reshape(1, KV, n_pages * page, D)
    q = case.q.view(B, KV, G, D)
    attend = _flex_compiled() if compiled else flex_attention

    def call():
        return attend(q, k, v, block_mask=physical, scale=case.sm_scale).reshape(B, H, D)

    return call


# -- FlashInfer ------------------------------------------------------------------


def _flashinfer_warm_one(num_q_heads: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> None:
    """Build and run FlashInfer on a tiny problem of this shape: compiles its JIT module into the cache."""
    import torch

    torch.manual_seed(0)
    page, pages = 16, 8
    dt = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
    pool = lambda: torch.randn(pages, page, num_kv_heads, head_dim, device="cuda").to(dt)
    case = Case(q=torch.randn(1, num_q_heads, head_dim, device="cuda").to(torch.bfloat16), k_pool=pool(),
                v_pool=pool(), block_tables=torch.arange(4, dtype=torch.int32, device="cuda").view(1, 4),
                seq_lens=torch.tensor([64], dtype=torch.int32, device="cuda"), context=64, page_size=page,
                num_kv_heads=num_kv_heads, k_scale=1.0, v_scale=1.0, sm_scale=1 / math.sqrt(head_dim),
                kv_dtype=kv_dtype)
    out = prepare_flashinfer(case)()
    torch.cuda.synchronize()
    if not bool(torch.isfinite(out.float()).all()):
        raise RuntimeError("FlashInfer produced non-finite values on the warm-up problem")


def flashinfer_prewarm(shapes: list[tuple[int, int, int]], kv_dtypes: list[str], *, timeout_s: float,
                       log_dir: Optional[str] = None, status_path: Optional[str] = None, min_late_s: float = 150.0,
                       command: Optional[Callable[..., list[str]]] = None, check_import: bool = True,
                       poll_s: float = 0.5) -> dict:
    """Compile the FlashInfer specs a sweep needs, each in its own process group, within ``timeout_s``.

    The CUDA-core decode specs (the Llama shapes, which the decisive configurations
    compare against) start at once. The tensor-core specs (group sizes the decode
    kernel has no instance for, e.g. 6 at head dim 256: FlashInfer builds its prefill
    kernels for them, the longest builds) start only once those have finished, and only
    if at least ``min_late_s`` of the cap is left; otherwise they are dropped as unable
    to build in time. ``status_path`` is rewritten whenever a spec starts, finishes
    or is dropped, so the sweep's late phase sees what is built so far.

    Returns ``{"specs": {name: {status, seconds, reason}}, ...}``; a status is one of
    ``queued``, ``building``, ``ok``, ``failed``, ``timeout``, ``dropped``, ``unavailable``.
    """
    names: dict = {}
    for h, kv, d in shapes:
        for dt in kv_dtypes:
            names.setdefault(flashinfer_spec(h, kv, d, dt), (h, kv, d, dt))
    state = {"specs": {n: {"status": "queued"} for n in names}, "timeout_s": timeout_s, "running": True}
    t_start = time.monotonic()

    def save() -> None:
        state["elapsed_s"] = round(time.monotonic() - t_start, 1)
        if status_path:
            tmp = f"{status_path}.tmp"
            with open(tmp, "w") as f:
                json.dump(state, f, indent=2)
            os.replace(tmp, status_path)

    if check_import:
        try:
            import flashinfer  # noqa: F401  (import errors are the same for every spec)
        except Exception as err:
            reason = f"flashinfer does not import ({type(err).__name__}: {err})"[:400]
            state.update(import_error=reason, running=False)
            state["specs"] = {n: {"status": "unavailable", "reason": reason} for n in names}
            save()
            return state
    if log_dir is None:  # the logs carry the reason a spec failed: keep them somewhere
        import tempfile

        log_dir = tempfile.mkdtemp(prefix="flashinfer_prewarm_")
    command = command or _warm_one_command
    waves = [[n for n in names if not n.endswith("tensorcore")], [n for n in names if n.endswith("tensorcore")]]
    running: dict = {}
    deadline = t_start + timeout_s

    def start(name: str) -> None:
        log = open(os.path.join(log_dir, f"flashinfer_{name}.log"), "w")
        proc = subprocess.Popen(command(*names[name]), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        running[name] = (proc, time.monotonic(), log)
        state["specs"][name] = {"status": "building", "started_s": round(time.monotonic() - t_start, 1)}

    def finish(name: str, status: str, reason: str = "") -> None:
        proc, t0, log = running.pop(name)
        log.close()
        if status == "failed":
            reason += ": " + _last_line(log.name)
        state["specs"][name] = {"status": status, "seconds": round(time.monotonic() - t0, 1), "reason": reason}

    try:
        for name in waves[0]:
            start(name)
        save()
        while running or waves[1]:
            if not running:  # the decisive specs are done: the long builds, if they can still finish
                left = deadline - time.monotonic()
                for name in waves[1]:
                    if left >= min_late_s:
                        start(name)
                    else:
                        state["specs"][name] = {"status": "dropped", "reason": (
                            f"cannot build in time: {max(left, 0):.0f} s of the {timeout_s:g} s cap left, a "
                            f"tensor-core build needs about {min_late_s:g} s")}
                waves[1] = []
                save()
                continue
            time.sleep(poll_s)
            changed = False
            for name, (proc, _, _) in list(running.items()):
                rc = proc.poll()
                if rc is not None:
                    finish(name, "ok" if rc == 0 else "failed", "" if rc == 0 else f"exit code {rc} "
                                                                                   f"(flashinfer_{name}.log)")
                    changed = True
            if time.monotonic() > deadline:
                for name in list(running):
                    _kill_group(running[name][0])
                    finish(name, "timeout", f"JIT compile did not finish within {timeout_s:g} s")
                for name in waves[1]:
                    state["specs"][name] = {"status": "dropped", "reason": "the cap was reached first"}
                waves[1] = []
                changed = True
            if changed:
                save()
    finally:  # SIGTERM (the caller's cap) or an error: no nvcc may outlive the prewarm
        for name in list(running):
            _kill_group(running[name][0])
            finish(name, "timeout", "the prewarm was stopped before this spec finished")
        state["running"] = False
        save()
    return state


def pending_builds(status: dict, specs) -> list[str]:
    """Of ``specs``, those a prewarm that is still running has yet to finish (queued or building)."""
    if not status.get("running"):
        return []
    return [v for v in specs if status.get("specs", {}).get(v, {}).get("status") in ("queued", "building")]


def _warm_one_command(h: int, kv: int, d: int, dt: str) -> list[str]:
    # From the repository root, like the caller (gpu_check.sh puts the root on PYTHONPATH too).
    return [sys.executable, "-m", "benchmarks.baselines", "flashinfer-warm-one", "--q-heads", str(h), "--kv-heads",
            str(kv), "--head-dim", str(d), "--kv-dtype", dt]


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the whole group: nvcc and ninja too
    except ProcessLookupError:
        pass
    proc.wait()


def _last_line(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
        return lines[-1][:300] if lines else ""
    except OSError:
        return ""


# -- registry ----------------------------------------------------------------------

BASELINES = {
    "sdpa_gather": ("PyTorch SDPA, page gather + fp8 dequant included", prepare_sdpa_gather),
    "sdpa_nogather": ("PyTorch SDPA over pre-gathered contiguous bf16 K/V (gather excluded)", prepare_sdpa_nogather),
    "flex_paged": ("FlexAttention paged decode (torch.compile, PagedAttention block mask)", prepare_flex_paged),
    "flashinfer": ("FlashInfer BatchDecodeWithPagedKVCacheWrapper", prepare_flashinfer),
}


# -- self test (CPU, needs PyTorch) ------------------------------------------------------


def selftest() -> int:
    """Check the SDPA and FlexAttention wiring on the CPU against a float64 computation."""
    import torch

    torch.manual_seed(0)
    B, H, KV, D, page, ctx, n_pages = 2, 6, 1, 64, 16, 100, 32
    pages = -(-ctx // page)
    perm = torch.randperm(n_pages)[: B * pages].view(B, pages).to(torch.int32)
    for kv_dtype in ("bf16", "fp8"):
        dt = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
        scale = 1.0 if kv_dtype == "bf16" else 6 / 448
        pool = lambda: (torch.randn(n_pages, page, KV, D) / scale).clamp(-448, 448).to(dt)
        case = Case(q=torch.randn(B, H, D).to(torch.bfloat16), k_pool=pool(), v_pool=pool(), block_tables=perm,
                    seq_lens=torch.full((B,), ctx, dtype=torch.int32), context=ctx, page_size=page,
                    num_kv_heads=KV, k_scale=scale, v_scale=scale, sm_scale=1 / math.sqrt(D), kv_dtype=kv_dtype)
        ref = _reference(case)
        for name in ("sdpa_gather", "sdpa_nogather", "flex_paged"):
            try:
                fn = (lambda c: prepare_flex_paged(c, compiled=False)) if name == "flex_paged" else BASELINES[name][1]
                out = fn(case)().double()
            except Unavailable as err:
                print(f"{kv_dtype} {name}: unavailable: {err}")
                continue
            err = (out - ref).abs().max().item()
            print(f"{kv_dtype} {name}: max abs error {err:.2e}")
            if not err < 2e-2:
                return 1
    return 0


def _reference(case: Case):
    """float64 decode of every sequence (small problems only)."""
    import torch

    out = []
    G = case.num_q_heads // case.num_kv_heads
    for s in range(case.batch):
        k = gather_dense(case, case.k_pool)[s].double()  # [KV, T, D]
        v = gather_dense(case, case.v_pool)[s].double()
        q = case.q[s].double().view(case.num_kv_heads, G, case.head_dim)
        p = torch.softmax(torch.einsum("kgd,ktd->kgt", q, k) * case.sm_scale, dim=-1)
        out.append(torch.einsum("kgt,ktd->kgd", p, v).reshape(case.num_q_heads, case.head_dim))
    return torch.stack(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("flashinfer-prewarm", help="compile the FlashInfer specs a sweep needs, with a cap")
    warm.add_argument("--shapes", default="24/4/256,32/8/128,64/8/128", help="q/kv/head_dim, comma-separated")
    warm.add_argument("--kv-dtypes", default="bf16,fp8")
    warm.add_argument("--timeout-s", type=float, default=300.0)
    warm.add_argument("--out", required=True, help="status JSON, rewritten as specs start and finish")
    warm.add_argument("--min-late-s", type=float, default=150.0,
                      help="start a tensor-core spec only with this much of the cap left")
    warm.add_argument("--log-dir")
    one = sub.add_parser("flashinfer-warm-one", help="(internal) compile one spec")
    one.add_argument("--q-heads", type=int, required=True)
    one.add_argument("--kv-heads", type=int, required=True)
    one.add_argument("--head-dim", type=int, required=True)
    one.add_argument("--kv-dtype", required=True)
    sub.add_parser("selftest", help="check the SDPA/Flex wiring on the CPU (needs PyTorch)")
    args = parser.parse_args(argv)
    if args.command == "selftest":
        return selftest()
    if args.command == "flashinfer-warm-one":
        _flashinfer_warm_one(args.q_heads, args.kv_heads, args.head_dim, args.kv_dtype)
        return 0
    shapes = [tuple(int(x) for x in s.split("/")) for s in args.shapes.split(",") if s]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # runs the prewarm's cleanup
    status = flashinfer_prewarm(shapes, args.kv_dtypes.split(","), timeout_s=args.timeout_s, log_dir=args.log_dir,
                                status_path=args.out, min_late_s=args.min_late_s)
    for name, entry in status["specs"].items():
        print(f"flashinfer {name}: {entry['status']} {entry.get('seconds', '')} {entry.get('reason', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
