"""Everything the CUDA-on-CPU shim reads from the environment, in one place.

  CUDA_ON_CPU_CACHE_DIR        where compiled libraries live when the caller names no
                               directory (else $XDG_CACHE_HOME/cuda-on-cpu, else
                               ~/.cache/cuda-on-cpu)
  CXX                          host compiler (default g++), may carry options
  METRALE_ATTN_CPU_ORDER       default thread-order policy for launch(order=None)
  METRALE_ATTN_CPU_FIBER       "asm" (default on x86-64) or "ucontext": the fiber switch
  METRALE_ATTN_CPU_STACK_KB    fiber stack size (default 256, ASan modules 1024)

Each is read when it is needed (a build, a launch), never at import, so a test may set
one with ``monkeypatch.setenv``. The three ``METRALE_ATTN_CPU_*`` names are those the shim
had inside metrale-attn, where it began.
"""

from __future__ import annotations

import os
import platform
import re
import shlex
from pathlib import Path

# Thread-order policies, as numbered by the runtime.
POLICIES = {"default": 0, "reverse": 1, "shuffle": 2, "warp-ahead": 3}


CACHE_DIR = "CUDA_ON_CPU_CACHE_DIR"


def cache_dir() -> Path:
    """Where compiled libraries live when the caller names no directory (created on demand)."""
    configured = os.environ.get(CACHE_DIR)
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg, "cuda-on-cpu") if xdg else Path.home() / ".cache" / "cuda-on-cpu"


def cxx() -> list[str]:
    """The host compiler's argv prefix: ``$CXX`` (options allowed), else ``g++``."""
    return shlex.split(os.environ.get("CXX") or "g++")


def fiber_impl() -> str:
    """The fiber switch: ``asm`` (x86-64 only) or ``ucontext``."""
    impl = os.environ.get("METRALE_ATTN_CPU_FIBER", "").strip() or "asm"
    if impl not in ("asm", "ucontext"):
        raise ValueError(f"METRALE_ATTN_CPU_FIBER must be 'asm' or 'ucontext', not {impl!r}")
    if platform.machine() not in ("x86_64", "AMD64"):
        impl = "ucontext"  # the hand-written switch is x86-64 only
    return impl


def stack_bytes(asan: bool) -> int:
    """Each fiber's stack, in bytes."""
    kb = os.environ.get("METRALE_ATTN_CPU_STACK_KB", "").strip()
    if not kb:
        return (1024 if asan else 256) * 1024
    kib = int(kb) if re.fullmatch(r"[0-9]+", kb) else -1
    if kib < 16:
        raise ValueError(f"METRALE_ATTN_CPU_STACK_KB must be a whole number of KiB >= 16, got {kb!r}")
    return kib * 1024


def parse_order(order: str | None) -> tuple[int, int]:
    """Thread-order policy -> (policy number, seed). None reads METRALE_ATTN_CPU_ORDER.

    "default" (thread order), "reverse", "shuffle:SEED" (a seeded permutation of the
    runnable threads every round), "warp-ahead:SEED" (warps as units; a random subset
    runs alone through each whole phase before the others start it). The two seeded
    policies also permute the block order. Anything else is a ValueError.
    """
    if order is None:
        order = os.environ.get("METRALE_ATTN_CPU_ORDER", "").strip() or "default"
    if order in ("default", "reverse"):
        return POLICIES[order], 0
    m = re.fullmatch(r"(shuffle|warp-ahead):(\d+)", order)
    if not m:
        raise ValueError(
            f"unknown thread order {order!r}: expected 'default', 'reverse', 'shuffle:SEED' or 'warp-ahead:SEED'"
        )
    return POLICIES[m.group(1)], int(m.group(2)) % (1 << 64)
