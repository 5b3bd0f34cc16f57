"""``merge_states``: merge two attention states of the same queries over disjoint keys.

Cascade and shared-prefix attention attend a common prefix once and each sequence's
suffix apart, then merge: with ``(v, s)`` a state's normalized output and the NATURAL
log of its softmax denominator (the ``lse`` ``DecodeAttention.run`` returns), the merge
of ``(v_a, s_a)`` and ``(v_b, s_b)`` is the state of the union of their keys:

    M = max(s_a, s_b), w = e^(s - M),  v = (w_a v_a + w_b v_b) / (w_a + w_b),  s = M + ln(w_a + w_b)

in one fixed order (a, then b), so the bytes are deterministic; an empty state (``s =
-inf``) has weight 0, whatever its ``v``; two empty states give ``v = 0``, ``s = -inf``.
The kernel is ``kernels_cu/merge_states.cu`` on either backend. Partial outputs in fp32
(``DecodeAttention(out_dtype="float32")``) keep the merged output within the 1-ulp bar
of attending the union at once; bf16/fp16 partials each carry their own rounding.
"""

from __future__ import annotations

import numpy as np

from . import dtypes
from .backends import Launch, get_backend
from .kernels import MergeStates
from .validation import aligned

STATE_DTYPES = (dtypes.BF16, dtypes.FP16, dtypes.FLOAT32)
_NUMPY = {dtypes.BF16: dtypes.NUMPY_DTYPES[dtypes.BF16], dtypes.FP16: dtypes.NUMPY_DTYPES[dtypes.FP16],
          dtypes.FLOAT32: np.dtype(np.float32)}


def merge_states(v_a, s_a, v_b, s_b, *, out=None, lse=None, backend=None):
    """Merge ``(v_a, s_a)`` and ``(v_b, s_b)``; returns ``(out, lse)``.

    Shapes: ``v_*`` and ``out`` ``[..., head_dim]`` (contiguous; bf16, fp16 or float32;
    ``out`` defaults to ``v_a``'s dtype), ``s_*`` and ``lse`` float32 ``[...]`` with the
    same leading shape (natural logs). ``backend``: ``"cpu"``, ``"cupy"`` or a backend;
    None picks the CPU backend for host arrays (NumPy, torch CPU tensors), else CuPy.
    Every array starts on a boundary of its element size (4 bytes for ``s_*`` and ``lse``).
    Outputs must be writable and may overlap no input. Errors name the argument and are
    raised before the launch.
    """
    if backend is None or isinstance(backend, str):
        backend = get_backend(backend or ("cpu" if _on_host(v_a) else "cupy"))
    infos = [backend.describe(x, name) for x, name in ((v_a, "v_a"), (s_a, "s_a"), (v_b, "v_b"), (s_b, "s_b"))]
    va, sa, vb, sb = infos
    if len(va.shape) < 1 or vb.shape != va.shape:
        raise ValueError(f"v_a and v_b must have one shape [..., head_dim], got {list(va.shape)} and {list(vb.shape)}")
    rows = va.shape[:-1]
    for info, name in ((sa, "s_a"), (sb, "s_b")):
        if info.shape != rows or dtypes.name_of(info.dtype) != dtypes.FLOAT32:
            raise ValueError(f"{name} must be float32 {list(rows)} (v's leading shape), got {info.dtype} "
                             f"{list(info.shape)}")
    in_dtype = dtypes.name_of(va.dtype)
    if in_dtype not in STATE_DTYPES or dtypes.name_of(vb.dtype) != in_dtype:
        raise ValueError(f"v_a and v_b must both hold one of bf16, fp16, float32, got {va.dtype} and {vb.dtype}")
    if out is None:
        out = backend.empty(va.shape, _NUMPY[in_dtype], like=v_a)
    if lse is None:
        lse = backend.empty(rows, np.float32, like=v_a)
    oi, li = backend.describe(out, "out"), backend.describe(lse, "lse")
    out_dtype = dtypes.name_of(oi.dtype)
    if oi.shape != va.shape or out_dtype not in STATE_DTYPES:
        raise ValueError(f"out must be bf16, fp16 or float32 {list(va.shape)}, got {oi.dtype} {list(oi.shape)}")
    if li.shape != rows or dtypes.name_of(li.dtype) != dtypes.FLOAT32:
        raise ValueError(f"lse must be float32 {list(rows)}, got {li.dtype} {list(li.shape)}")
    for info, name in zip(infos + [oi, li], ("v_a", "s_a", "v_b", "s_b", "out", "lse")):
        if 0 not in info.shape and info.strides != _contiguous(info.shape):  # empty: no stride matters
            raise ValueError(f"{name} must be contiguous, got strides {list(info.strides)}")
        if info.device != backend.current_device():
            raise ValueError(f"{name} is not on the backend's device")
        aligned(info, name, info.itemsize)  # the kernel loads and stores whole elements (a GPU faults otherwise)
    for info, name in ((oi, "out"), (li, "lse")):
        if not info.writable:
            raise ValueError(f"{name} must be writable, got a read-only array")
    for name, info in (("out", oi), ("lse", li)):
        mine = info.byte_range()
        for other, theirs in zip(("v_a", "s_a", "v_b", "s_b", "out"), (va, sa, vb, sb, oi)):
            if theirs is info or mine is None or theirs.byte_range() is None:
                continue
            (a0, a1), (b0, b1) = mine, theirs.byte_range()
            if a0 < b1 and b0 < a1:
                raise ValueError(f"{name} overlaps {other} in memory: pass a separate {name}")
    count = int(np.prod(rows, dtype=np.int64))
    if count:
        kernel = MergeStates(in_dtype, out_dtype)
        module, ptr = backend.load(kernel), backend.pointer
        module.launch(Launch(kernel.kernels[0], (count, 1, 1), (kernel.threads, 1, 1), 0,
                             (ptr(v_a, va), ptr(s_a, sa), ptr(v_b, vb), ptr(s_b, sb), ptr(out, oi), ptr(lse, li),
                              np.int32(va.shape[-1]))))
    return out, lse


def _on_host(array) -> bool:
    """A NumPy array or a torch CPU tensor (without importing torch)."""
    if isinstance(array, np.ndarray):
        return True
    device = getattr(array, "device", None)
    return type(array).__module__.startswith("torch") and getattr(device, "type", None) == "cpu"


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))
