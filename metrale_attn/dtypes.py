"""The element types q, out and the KV cache may have, and their spellings.

One canonical short name per type (``bf16``, ``fp16``, ``fp8``), used in spec
names and mapped to the ``PD_DTYPE_*`` codes the kernels read. Users may spell a
dtype as a string (``"bfloat16"``, ``"float16"``, ``"fp8_e4m3"``), a NumPy or
ml_dtypes dtype, or a torch dtype.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

BF16, FP16, FP8, FP8_E5M2 = "bf16", "fp16", "fp8", "fp8e5m2"
Q_DTYPES = (BF16, FP16)
KV_DTYPES = (BF16, FP16, FP8, FP8_E5M2)
FP8_KINDS = (FP8, FP8_E5M2)
"""The one-byte caches: given as their ml_dtypes type or as uint8 bits of it."""

NUMPY_DTYPES = {
    BF16: np.dtype(ml_dtypes.bfloat16),
    FP16: np.dtype(np.float16),
    FP8: np.dtype(ml_dtypes.float8_e4m3fn),
    FP8_E5M2: np.dtype(ml_dtypes.float8_e5m2),
}
CODE_DEFINES = {BF16: "PD_DTYPE_BF16", FP16: "PD_DTYPE_FP16", FP8: "PD_DTYPE_FP8_E4M3",
                FP8_E5M2: "PD_DTYPE_FP8_E5M2", "float32": "PD_DTYPE_FP32"}
"""The kernels' ``#define`` naming each type's code (read back from the header)."""

INT32, FLOAT32 = "int32", "float32"
_TORCH = {"torch.bfloat16": BF16, "torch.float16": FP16, "torch.float8_e4m3fn": FP8, "torch.uint8": FP8,
          "torch.float8_e5m2": FP8_E5M2,
          "torch.int32": INT32, "torch.float32": FLOAT32}
_SPELLINGS = {
    "bf16": BF16, "bfloat16": BF16,
    "fp16": FP16, "float16": FP16, "half": FP16,
    "fp8": FP8, "fp8_e4m3": FP8, "fp8e4m3": FP8, "float8_e4m3fn": FP8, "e4m3": FP8,
    "fp8_e5m2": FP8_E5M2, "fp8e5m2": FP8_E5M2, "float8_e5m2": FP8_E5M2, "e5m2": FP8_E5M2,
    "float32": "float32", "fp32": "float32",
}


def canonical(dtype, *, argument: str, allowed: tuple[str, ...]) -> str:
    """The canonical name of ``dtype``, or a ValueError naming ``argument``.

    A ``uint8`` array dtype stands for fp8 e4m3 bits where fp8 is allowed.
    """
    try:
        name = name_of(dtype)
    except TypeError:  # unhashable: certainly not a dtype
        name = None
    if name not in allowed:
        raise ValueError(f"{argument} must be one of {', '.join(allowed)}; got {dtype!r}")
    return name


@functools.lru_cache(maxsize=256)
def name_of(dtype) -> str | None:
    """The canonical name of a dtype or spelling (``bf16``, ``fp16``, ``fp8``, and
    ``int32``/``float32`` for the index and lse arrays), or None when it is none of
    ours. Memoized: ``run`` asks this for every argument of every call."""
    if isinstance(dtype, str):
        return _SPELLINGS.get(dtype.strip().lower())
    text = str(dtype)
    if text.startswith("torch."):  # a torch dtype, without importing torch
        return _TORCH.get(text)
    try:
        npd = np.dtype(dtype)
    except TypeError:
        return None
    if npd == np.uint8:
        return FP8
    for name, candidate in NUMPY_DTYPES.items():
        if npd == candidate:
            return name
    return {np.dtype(np.int32): INT32, np.dtype(np.float32): FLOAT32}.get(npd)
