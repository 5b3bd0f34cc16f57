"""Child process for isolated and AddressSanitizer launches (see isolation.launch_in_child).

Usage: python -m cuda_on_cpu._child REQUEST.pkl RESULT.pkl

The request names a compiled library and either asks for its kernel metadata
("describe") or for one launch with shipped arrays. Arrays are re-created with
posix_memalign at exactly their size (64-byte aligned), so ASan sees the first byte past
each one. Exit status 0: result written; 3: launch error (message in the result); anything
else: the launch crashed or ASan reported (the report is on stderr).
"""

from __future__ import annotations

import ctypes
import pickle
import sys

from cuda_on_cpu.abi import launch_raw, read_descs
from cuda_on_cpu.errors import CudaOnCpuError
from cuda_on_cpu.isolation import CHILD_LAUNCH_ERROR


def _aligned_copy(libc, data: bytes) -> int:
    ptr = ctypes.c_void_p()
    if libc.posix_memalign(ctypes.byref(ptr), 64, len(data)) != 0:
        raise MemoryError("posix_memalign failed")
    if data:
        ctypes.memmove(ptr, data, len(data))
    return ptr.value or 0


def main(req_path: str, out_path: str) -> int:
    with open(req_path, "rb") as f:
        req = pickle.load(f)
    lib = ctypes.CDLL(req["so"])
    if req["op"] == "describe":
        result = {"meta": read_descs(lib)}
        status = 0
    else:
        libc = ctypes.CDLL(None)
        libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        ptrs = [_aligned_copy(libc, data) for data in req["arrays"]]
        values = []
        for spec in req["args"]:
            if spec[0] == "array":
                values.append(ptrs[spec[1]])
            elif spec[0] == "bytes":
                values.append(spec[1])
            else:
                values.append(None)
        try:
            launch_raw(lib, req["kernel_index"], req["grid"], req["block"], req["shared_bytes"],
                       values, req["policy"], req["seed"], req["stack_bytes"])
        except CudaOnCpuError as e:
            result, status = {"error": str(e)}, CHILD_LAUNCH_ERROR
        else:
            result = {"arrays": [ctypes.string_at(p, len(d)) if d else b""
                                 for p, d in zip(ptrs, req["arrays"])]}
            status = 0
        for p in ptrs:
            libc.free(p)
    with open(out_path, "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
