"""What the CUDA-on-CPU backend raises: a launch CUDA would reject or that misbehaved, and a
build the host compiler refused."""

from __future__ import annotations


class CudaOnCpuError(RuntimeError):
    """A launch that CUDA would reject, or that misbehaved (barrier/warp-op misuse,
    argument mismatch, AddressSanitizer report, crash of an isolated launch)."""


class CudaOnCpuCompileError(CudaOnCpuError):
    """The host compiler rejected the source; the message is the compiler's output."""
