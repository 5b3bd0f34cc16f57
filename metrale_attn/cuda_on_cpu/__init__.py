"""CUDA-on-CPU: run the package's CUDA C kernels, unchanged, on the host CPU.

The same .cu sources that NVRTC compiles for the GPU are compiled with the host C++
compiler against a small shim (cuda_on_cpu.h) and run with CUDA semantics: every CUDA
thread is a fiber, blocks run one after another, barriers and warp intrinsics are real
synchronisation points, and their misuse is reported instead of hanging. This is the
``cpu`` backend CI uses.

    from metrale_attn.cuda_on_cpu import compile_module
    mod = compile_module(source, name="variant", defines={"HEAD_DIM": 128})
    mod.launch("kernel", (blocks, 1, 1), (128, 1, 1), 0, (out, inp, np.int32(n)))

See loader.py for the API details (caching, thread-order policies, ASan, crash policy)
and cuda_on_cpu.h for the kernel dialect and the semantics.
"""

from .loader import (
    CudaOnCpuCompileError,
    CudaOnCpuError,
    Module,
    Param,
    compile_module,
    parse_order,
)

__all__ = [
    "CudaOnCpuCompileError",
    "CudaOnCpuError",
    "Module",
    "Param",
    "compile_module",
    "parse_order",
]
