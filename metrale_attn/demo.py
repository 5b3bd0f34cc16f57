"""``metrale-attn demo``: a realistic mixed decode batch, checked against the reference."""

from __future__ import annotations

from typing import Optional


def run_demo(backend: Optional[str] = None, target: Optional[str] = None, seed: int = 0) -> int:
    print("metrale-attn demo: the paged-decode kernels have not landed yet; try `metrale-attn plan --model llama-3-8b`.")
    return 0
