"""Child processes: launches isolated from this process, and every ASan launch.

A child (``python -m cuda_on_cpu._child``) gets a pickled request: a
library and either "describe" (read its kernel table) or one launch with its arrays
shipped by value. Each distinct array is shipped once, so aliasing arguments stay
aliased in the child; partial overlaps cannot be reproduced there and are refused.
The child exits 0 with a result, ``CHILD_LAUNCH_ERROR`` with a launch error's message,
or anything else (a signal, ``asan.EXITCODE``) with the story on its stderr.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from . import asan
from .errors import CudaOnCpuCompileError, CudaOnCpuError

CHILD_LAUNCH_ERROR = 3  # the child's exit status for a CudaOnCpuError


def _child_env(with_asan: bool) -> dict:
    env = dict(os.environ)
    pkg_root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if with_asan:
        asan.child_env(env)
    return env


def _run_child(request: dict, with_asan: bool) -> tuple[subprocess.CompletedProcess, dict | None]:
    with tempfile.TemporaryDirectory(prefix="cocpu-child-") as td:
        req_path, out_path = Path(td) / "request.pkl", Path(td) / "result.pkl"
        req_path.write_bytes(pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL))
        proc = subprocess.run(
            [sys.executable, "-m", "cuda_on_cpu._child", str(req_path), str(out_path)],
            env=_child_env(with_asan), capture_output=True, text=True)
        result = pickle.loads(out_path.read_bytes()) if out_path.exists() else None
    return proc, result


def child_describe(so_path: Path) -> dict:
    """The kernel table of an ASan build, read in a child (this process has no libasan)."""
    proc, result = _run_child({"op": "describe", "so": str(so_path)}, with_asan=True)
    if proc.returncode != 0 or result is None:
        raise CudaOnCpuCompileError(f"cannot load the ASan build {so_path.name}:\n{proc.stderr.strip()}")
    return result["meta"]


def launch_in_child(so_path: Path, with_asan: bool, kernel: str, kernel_index: int, grid, block, shared_bytes,
                    values, policy, seed, stack) -> None:
    """One launch in a child process: ``values`` as from ``abi.prepare_args`` (arrays are
    shipped there and written back when writable); a launch error, an ASan report or a
    crash becomes a CudaOnCpuError."""
    # Ship each distinct array once (by data pointer), so aliasing arguments stay aliased;
    # partial overlaps cannot be reproduced in the child and are refused.
    arrays: list[np.ndarray] = []
    slots: dict[tuple[int, int], int] = {}
    spec = []
    for v in values:
        if isinstance(v, np.ndarray):
            key = (v.ctypes.data, v.nbytes)
            if key not in slots:
                lo, hi = key[0], key[0] + key[1]
                for a in arrays:
                    if a.nbytes and v.nbytes and lo < a.ctypes.data + a.nbytes and a.ctypes.data < hi:
                        raise CudaOnCpuError(f"kernel '{kernel}': partially overlapping array arguments "
                                             "cannot be shipped to a child process")
                slots[key] = len(arrays)
                arrays.append(v)
            spec.append(("array", slots[key]))
        else:
            spec.append(("none",) if v is None else ("bytes", v))
    request = {
        "op": "launch", "so": str(so_path), "kernel_index": kernel_index,
        "grid": grid, "block": block, "shared_bytes": shared_bytes, "policy": policy,
        "seed": seed, "stack_bytes": stack, "args": spec,
        "arrays": [a.reshape(-1).view(np.uint8).tobytes() for a in arrays],
    }
    proc, result = _run_child(request, with_asan)
    if proc.returncode == 0 and result is not None:
        for a, data in zip(arrays, result["arrays"]):
            if a.flags.writeable:
                a.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, dtype=np.uint8)
        return
    if proc.returncode == CHILD_LAUNCH_ERROR and result is not None:
        raise CudaOnCpuError(result["error"])
    stderr = proc.stderr.strip()
    report = asan.report_in(stderr, so_path)
    if report is not None:
        raise CudaOnCpuError(f"AddressSanitizer report for kernel '{kernel}':\n{report}")
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    raise CudaOnCpuError(f"kernel '{kernel}' crashed the launch process ({how}):\n{stderr}")
