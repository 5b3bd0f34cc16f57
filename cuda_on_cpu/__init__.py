"""CUDA-on-CPU: run the package's CUDA C kernels, unchanged, on the host CPU.

The same .cu sources that NVRTC compiles for the GPU are compiled with the host C++
compiler against a small shim (cuda_on_cpu.h) and run with CUDA semantics: every CUDA
thread is a fiber, blocks run one after another, barriers and warp intrinsics are real
synchronisation points, and their misuse is reported instead of hanging. This is the
``cpu`` backend CI uses.

    from cuda_on_cpu import compile_module
    mod = compile_module(source, name="variant", defines={"HEAD_DIM": 128})
    mod.launch("kernel", (blocks, 1, 1), (128, 1, 1), 0, (out, inp, np.int32(n)))

The modules, lowest first (each imports only those above it in this list):

    errors        CudaOnCpuError, CudaOnCpuCompileError
    environment   every environment variable the backend reads; thread-order policies
    declarations  the C-declaration parser: the kernels a source defines, their
                  registration table
    abi           the runtime's C ABI: the kernel table read back, argument marshalling,
                  the cocpu_launch call
    asan          AddressSanitizer builds: flags, libasan, options, reports
    isolation     child processes: isolated and ASan launches
    module        Module: a compiled variant and its launches (crash policy)
    build         compile_module: build, on-disk cache (records checked before loading),
                  in-process memo
    _child        the child process's entry point

cuda_on_cpu.h documents the kernel dialect and the semantics.
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
