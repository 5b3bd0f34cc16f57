"""CUDA-on-CPU: run CUDA C kernels, unchanged, on the host CPU, with CUDA semantics.

The same .cu sources that NVRTC compiles for the GPU are compiled with the host C++
compiler against a small shim (cuda_on_cpu.h) and run with CUDA semantics: every CUDA
thread is a fiber, blocks run one after another, barriers and warp intrinsics are real
synchronisation points, and their misuse is reported instead of hanging. metrale-attn's
``cpu`` backend runs on it; it imports nothing of metrale-attn (README.md says how to use it).

    from cuda_on_cpu import compile_module
    mod = compile_module(source, name="variant", defines={"HEAD_DIM": 128})
    mod.launch("kernel", (blocks, 1, 1), (128, 1, 1), 0, (out, inp, np.int32(n)))

The modules, lowest first (each imports only those above it in this list):

    errors        CudaOnCpuError, CudaOnCpuCompileError
    environment   every environment variable the shim reads (its cache directory among
                  them); thread-order policies
    declarations  the C-declaration parser: the kernels a source defines, their
                  registration table
    abi           the runtime's C ABI: the kernel table read back, argument marshalling,
                  the cocpu_launch call
    asan          AddressSanitizer builds: flags, libasan, options, reports
    isolation     child processes: isolated and ASan launches
    module        Module: a compiled variant and its launches (crash policy)
    build         compile_module: build (the runtime objects once per set of flags),
                  on-disk cache (records checked before loading), in-process memo
    _child        the child process's entry point

The C++ side: cuda_on_cpu.h, the kernel-facing header (it documents the kernel dialect
and the semantics), and the runtime every library links, by job:

    runtime/internal.h        what the runtime's translation units share
    runtime/launch.cpp        the entry points the loader calls (cocpu_launch, ...)
    runtime/scheduler.cpp     fibers and the block scheduler: stacks, context switches,
                              thread orders, barriers, shuffles and votes, shared memory
    runtime/ptx.cpp           the PTX emulation: ldmatrix, movmatrix, mma, cp.async
    runtime/errors.cpp        error messages and crash reports (SIGSEGV/SIGBUS, ASan)
    runtime/switch_x86_64.S   the fiber switch on x86-64 (ucontext elsewhere)

Its tests are in tests/ beside this file, its speed scripts in bench/ (neither shipped).
"""

from .abi import Param
from .build import compile_module
from .environment import parse_order
from .errors import CudaOnCpuCompileError, CudaOnCpuError
from .module import Module

__all__ = [
    "CudaOnCpuCompileError",
    "CudaOnCpuError",
    "Module",
    "Param",
    "compile_module",
    "parse_order",
]
