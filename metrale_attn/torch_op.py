"""PyTorch integration: the custom op ``torch.ops.metrale_attn.paged_decode``, and zero-copy
NumPy <-> torch views for bf16 and fp8 (which ``torch.from_numpy`` refuses).

Importing this module imports torch and registers the op; ``import metrale_attn`` alone
never imports torch. Usage (a layer keeps its object and the object's int handle)::

    attn = DecodeAttention(32, 8, 128, 16, q_dtype="bfloat16", kv_dtype="bfloat16", max_batch=256,
                           workspace=shared_workspace)
    handle = attn.handle                      # once, outside any compiled code
    out = torch.empty_like(q)                 # [num_seqs, num_q_heads, head_dim]
    torch.ops.metrale_attn.paged_decode(handle, q, k_cache, v_cache, block_tables, seq_lens, out, None,
                                        k_scale, v_scale)

The op's schema is ``SCHEMA``: the plain call's arguments, then every feature's arrays
(``features.FEATURE_ARRAYS``, in their records' order, each ``Tensor? name=None``), so a feature
that takes arrays reaches the op, its fake and ``decode`` from its record alone.
"""

from __future__ import annotations

import inspect
from typing import Optional

import ml_dtypes
import numpy as np
import torch

from .attention import DecodeAttention
from .features import FEATURE_ARRAYS

_SAME_SIZE_INT = {1: np.uint8, 2: np.int16}
_TO_TORCH = {np.dtype(ml_dtypes.bfloat16): torch.bfloat16, np.dtype(ml_dtypes.float8_e4m3fn): torch.float8_e4m3fn,
             np.dtype(ml_dtypes.float8_e5m2): torch.float8_e5m2}
_TO_NUMPY = {wanted: numpy for numpy, wanted in _TO_TORCH.items()}


def from_numpy(array: np.ndarray) -> torch.Tensor:
    """A torch CPU tensor sharing ``array``'s memory (no copy), ml_dtypes bf16 and fp8
    included (as ``torch.bfloat16``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``);
    strides kept."""
    wanted = _TO_TORCH.get(array.dtype)
    if wanted is None:
        return torch.from_numpy(array)
    return torch.from_numpy(array.view(_SAME_SIZE_INT[array.dtype.itemsize])).view(wanted)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A NumPy view of a torch CPU tensor's memory (no copy), bf16 and fp8 as ml_dtypes."""
    wanted = _TO_NUMPY.get(tensor.dtype)
    tensor = tensor.detach()
    if wanted is None:
        return tensor.numpy()
    bits = {1: torch.uint8, 2: torch.int16}[tensor.element_size()]
    return tensor.view(bits).numpy().view(wanted)


# -- the custom op -------------------------------------------------------------------------


_FEATURE_ARRAYS = tuple(a.name for a in FEATURE_ARRAYS)
SCHEMA = ("paged_decode(int handle, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? block_tables, "
          "Tensor? seq_lens, Tensor(a!) out, Tensor(b!)? lse, float k_scale=1.0, float v_scale=1.0"
          + "".join(f", Tensor? {name}=None" for name in _FEATURE_ARRAYS) + ") -> ()")
"""The op's schema: it returns nothing and writes ``out`` (and ``lse``) in place."""


def paged_decode(handle: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: Optional[torch.Tensor], seq_lens: Optional[torch.Tensor], out: torch.Tensor,
                 lse: Optional[torch.Tensor], k_scale: float = 1.0, v_scale: float = 1.0, *arrays) -> None:
    """``DecodeAttention.from_handle(handle).run(q, k_cache, v_cache, block_tables, seq_lens,
    k_scale=, v_scale=, out=out, lse=lse, sinks=, k_scales=, v_scales=, kv_indptr=, kv_indices=,
    kv_last_page_len=)`` (``arrays``: the features' arrays, in ``SCHEMA``'s order, None where
    absent): writes ``out`` (and ``lse`` when given) in place. q and out are 3-D, or 4-D
    ``[num_seqs, q_len, num_q_heads, head_dim]`` for an object built with ``max_q_len > 1``.

    The implementation of ``torch.ops.metrale_attn.paged_decode`` for CPU and CUDA
    tensors. ``torch.compile`` sees an opaque op that mutates ``out`` and ``lse`` (its
    fake implementation computes nothing), so a decode step that calls it compiles
    without a graph break, and a CUDA graph capturing the step records the kernels (they
    launch on torch's current stream). ``handle`` is ``attn.handle``, an int a layer
    keeps beside its other state, as vLLM keeps a layer's name: a compiled graph holds
    it as a constant."""
    given = {name: a for name, a in zip(_FEATURE_ARRAYS, arrays) if a is not None}
    DecodeAttention.from_handle(handle).run(q, k_cache, v_cache, block_tables, seq_lens, k_scale=k_scale,
                                            v_scale=v_scale, out=out, lse=lse, **given)


def _paged_decode_fake(handle, q, k_cache, v_cache, block_tables, seq_lens, out, lse, k_scale=1.0, v_scale=1.0,
                       *arrays):
    """Nothing to compute (the op returns nothing); devices, ranks and dtypes are checked
    here so a mistake shows at trace time (a feature's arrays as their records say). Sizes
    are left to the real call: comparing symbolic sizes here would add guards to the caller's
    graph. Tensors on several devices (a ``meta`` q beside CPU caches dispatches here, not to
    the CPU kernel) are refused, as torch's own ops refuse them, rather than returning with
    ``out`` unwritten."""
    tensors = [t for t in (q, k_cache, v_cache, block_tables, seq_lens, out, lse, *arrays) if t is not None]
    if len({t.device for t in tensors}) > 1:
        raise ValueError(f"paged_decode: every tensor must be on one device, got "
                         f"{', '.join(sorted({str(t.device) for t in tensors}))}")
    if q.dim() not in (3, 4) or out.dim() != q.dim() or out.dtype not in (q.dtype, torch.float32):
        raise ValueError(f"paged_decode: q and out must be [num_seqs, (q_len,) num_q_heads, head_dim], out of q's "
                         f"dtype or float32, got {q.dtype} {q.dim()}-D and {out.dtype} {out.dim()}-D")
    if lse is not None and (lse.dim() != q.dim() - 1 or lse.dtype != torch.float32):
        raise ValueError(f"paged_decode: lse must be float32 [num_seqs, (q_len,) num_q_heads], got {lse.dtype} "
                         f"{lse.dim()}-D")
    if any(t is not None and t.dtype != torch.int32 for t in (block_tables, seq_lens)):
        raise ValueError("paged_decode: block_tables and seq_lens must be int32")
    for record, t in zip(FEATURE_ARRAYS, arrays):
        if t is not None and (t.dim() not in record.ranks or t.dtype != getattr(torch, record.dtype)):
            raise ValueError(f"paged_decode: {record.name} must be {record.dtype} {record.shape}, got {t.dtype} "
                             f"{t.dim()}-D")


def _schema_signature(fn) -> None:
    """Give ``fn(..., *arrays)`` the signature ``SCHEMA`` says (each feature array a parameter
    named after it, None by default), for ``inspect`` and ``help``: torch's dispatcher passes
    every argument of the schema by position, so the function itself takes them as ``*arrays``."""
    signature = inspect.signature(fn)
    plain = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_POSITIONAL]
    fn.__signature__ = signature.replace(parameters=plain + [
        inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in _FEATURE_ARRAYS])


_schema_signature(paged_decode)
_schema_signature(_paged_decode_fake)
# Registered through torch.library.Library, not the torch.library.custom_op decorator: the
# decorator's Python dispatch (its autograd and mutation-checking wrappers) costs 25-40 us
# per call on the CI machine against ~5 us for a kernel registered per dispatch key
# (benchmarks/NOTES.md), paid once per layer per step in eager mode. vLLM registers its
# ops the same way (direct_register_custom_op) for the same reason. torch.compile treats
# both alike: a mutating op with a fake implementation, functionalized and re-inplaced.
_LIBRARY = torch.library.Library("metrale_attn", "DEF")
_LIBRARY.define(SCHEMA)
for _key in ("CPU", "CUDA"):
    _LIBRARY.impl("paged_decode", paged_decode, _key)
# A tensor without strided storage (sparse, mkldnn) dispatches to its layout's key: the same
# implementation there, whose backend refuses that tensor naming the argument, where torch
# would say only that the op has no kernel for the key.
for _key in ("SparseCPU", "SparseCUDA", "SparseCsrCPU", "SparseCsrCUDA", "MkldnnCPU"):
    _LIBRARY.impl("paged_decode", paged_decode, _key)
torch.library.register_fake("metrale_attn::paged_decode", _paged_decode_fake, lib=_LIBRARY)


def decode(attn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
           seq_lens: torch.Tensor, out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None, *,
           k_scale: float = 1.0, v_scale: float = 1.0, **arrays: Optional[torch.Tensor]) -> torch.Tensor:
    """``out`` after ``torch.ops.metrale_attn.paged_decode`` (a new tensor like ``q``, of the
    object's ``out_dtype``, when not given). ``arrays``: the features' arrays by name (``sinks=``,
    ``k_scales=``, ``v_scales=``, ``kv_indptr=``, ...: ``SCHEMA``'s last arguments). ``attn``: a
    ``DecodeAttention`` or its ``handle``; under ``torch.compile`` pass the int (read
    ``attn.handle`` once, outside the compiled code)."""
    unknown = sorted(set(arrays) - set(_FEATURE_ARRAYS))
    if unknown:
        raise TypeError(f"decode() got an unexpected keyword argument {unknown[0]!r}")
    handle = attn if isinstance(attn, int) else attn.handle
    if out is None:
        wide = DecodeAttention.from_handle(handle).out_dtype == "float32"
        out = torch.empty_like(q, dtype=torch.float32) if wide else torch.empty_like(q)
    torch.ops.metrale_attn.paged_decode(handle, q, k_cache, v_cache, block_tables, seq_lens, out, lse, k_scale,
                                        v_scale, *map(arrays.get, _FEATURE_ARRAYS))
    return out
