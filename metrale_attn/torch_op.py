"""PyTorch integration: the custom op ``torch.ops.metrale_attn.paged_decode``, and zero-copy
NumPy <-> torch views for bf16 and fp8 (which ``torch.from_numpy`` refuses).

Importing this module imports torch and registers the op; ``import metrale_attn`` alone
never imports torch.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

_SAME_SIZE_INT = {1: np.uint8, 2: np.int16}
_TO_TORCH = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn}
_TO_NUMPY = {torch.bfloat16: np.dtype(ml_dtypes.bfloat16), torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn)}


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch CPU tensor sharing ``array``'s memory (no copy), ml_dtypes bf16 and fp8
    e4m3 included (as ``torch.bfloat16`` / ``torch.float8_e4m3fn``); strides kept."""
    wanted = _TO_TORCH.get(array.dtype)
    if wanted is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(_SAME_SIZE_INT[array.dtype.itemsize])).view(wanted)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a torch CPU tensor's memory (no copy), bf16 and fp8 e4m3 as ml_dtypes."""
    wanted = _TO_NUMPY.get(tensor.dtype)
    tensor = tensor.detach()
    if wanted is None:
        return tensor.numpy()
    bits = {1: torch.uint8, 2: torch.int16}[tensor.element_size()]
    return tensor.view(bits).numpy().view(wanted)
