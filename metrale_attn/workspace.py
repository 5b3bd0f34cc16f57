"""The split-K workspace: sized once, allocated or adopted once, shared between layers.

A layer's kernels write their split-K partials (``plan.Workspace``: slots of ``[o[head_dim],
m, l]`` fp32) into one buffer, allocated at construction for ``max_batch`` rows or passed
in by the caller, who may share one buffer between every layer of a model
(``workspace_bytes`` sizes it). The layers that share one buffer form a ``SharedWorkspace``:
one call's launches at a time (a lock), one stream at a time.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Optional

import numpy as np

from .backends import get_backend
from .config import MAX_Q_LEN, LayerConfig, ModelShape, int_in
from .plan import LEGACY_MAX_DECODE_SEQS, Workspace, workspace_for
from .targets import resolve_target_policy, target_for
from .validation import aligned, overlap, writable


def layer_workspace(config: LayerConfig) -> Workspace:
    """The workspace a layer needs: ``plan.workspace_for`` its policy, shape and rows."""
    return workspace_for(config.target_policy, config.shape, max_batch=config.max_batch,
                         max_decode_seqs=config.max_decode_seqs, max_q_len=config.max_q_len)


def allocate(backend, config: LayerConfig, size: Workspace):
    """A new workspace of ``size.nbytes`` on ``backend``, or a MemoryError saying what to lower."""
    try:
        return backend.empty((size.slots * size.slot_floats,), np.float32)
    except MemoryError as err:  # CuPy's OutOfMemoryError is one too
        raise MemoryError(
            f"cannot allocate the split-K workspace of {size.nbytes} bytes ({size.slots} slots x "
            f"{size.slot_floats} fp32) for max_batch={config.max_batch}, {config.shape.num_q_heads} q heads and "
            f"attn_decode_splitk={config.target_policy.splitk.label()}: lower max_batch (the workspace grows "
            f"linearly with it) or pin fewer splits (splitk=)"
        ) from err


def adopt(backend, workspace, config: LayerConfig, size: Workspace, device):
    """A caller's workspace, after checking that it can hold this layer's partials: on
    ``device``, dense, writable, 16-byte aligned, and at least ``size.nbytes`` bytes (any
    dtype: it is used as bytes)."""
    info = backend.describe(workspace, "workspace")
    span = info.byte_range()
    nbytes = 0 if span is None else span[1] - span[0]
    if info.device != device:
        raise ValueError(f"workspace must be on the device this DecodeAttention is built on "
                         f"({where(device)}), got {where(info.device)}")
    if span is not None and (nbytes != math.prod(info.shape) * info.itemsize or span[0] != info.ptr):
        raise ValueError(f"workspace must be a dense array (no gaps, no negative strides), got shape "
                         f"{list(info.shape)} strides {list(info.strides)}")
    writable(info, "workspace")
    aligned(info, "workspace")
    if nbytes < size.nbytes:
        raise ValueError(
            f"workspace too small: it has {nbytes} bytes, but this DecodeAttention needs {size.nbytes} bytes "
            f"({size.slots} slots x {size.slot_floats} fp32 for max_batch={config.max_batch}, "
            f"{config.shape.num_q_heads} q heads, attn_decode_splitk={config.target_policy.splitk.label()}); size one "
            "for every layer shape with metrale_attn.workspace_bytes(...)")
    return workspace


def storage_guard(workspace, nbytes: int):
    """For a torch tensor, a check that it still holds its memory at the address the
    launches use, at least ``nbytes`` of it (a caller can free or swap a tensor's storage
    in place: ``untyped_storage().resize_(0)``, ``set_()``); None for an array whose
    memory cannot move while it is referenced (NumPy, CuPy). About a microsecond."""
    storage_of = getattr(workspace, "untyped_storage", None)
    if storage_of is None:
        return None
    ptr = workspace.data_ptr()

    def check() -> None:
        storage = storage_of()
        if workspace.data_ptr() != ptr or storage.data_ptr() + storage.nbytes() - ptr < nbytes:
            raise ValueError(f"the workspace tensor no longer holds its memory (it was at {ptr:#x}, {nbytes} bytes; "
                             f"now {workspace.data_ptr():#x} in a storage of {storage.nbytes()} bytes): its storage "
                             "was freed or replaced; the objects built on it cannot run")
    return check


class SharedWorkspace:
    """What the layers sharing one workspace share: the lock under which one call's
    launches run (a split kernel and its merge, which must not interleave with another
    call's), and the stream of the last launch into it (``StreamReuseWarning``).

    Layers join by the workspace's byte range: one whose workspace overlaps a live
    group's joins it (the group's range grows to cover both); one that would bridge two
    groups is refused (their layers already hold different locks)."""

    __slots__ = ("lock", "last_stream", "device", "span", "__weakref__")
    _live: "weakref.WeakSet[SharedWorkspace]" = weakref.WeakSet()
    _registry = threading.Lock()

    def __init__(self, device, span):
        self.lock, self.last_stream, self.device, self.span = threading.Lock(), None, device, span

    @classmethod
    def join(cls, device, span) -> "SharedWorkspace":
        if span is None:  # an empty workspace: nothing to share
            return cls(device, None)
        with cls._registry:
            found = [g for g in list(cls._live) if g.device == device and overlap(g.span, span)]
            if len(found) > 1:
                raise ValueError(f"workspace (bytes {span[0]:#x}..{span[1]:#x}) overlaps the workspaces of "
                                 f"{len(found)} groups of DecodeAttention objects that do not share one: pass every "
                                 "object the same buffer (or disjoint ones)")
            if found:
                group = found[0]
                group.span = (min(group.span[0], span[0]), max(group.span[1], span[1]))
            else:
                group = cls(device, span)
                cls._live.add(group)
            return group


def workspace_bytes(shapes, *, max_batch: int, backend=None, target: Optional[str] = None,
                    splitk: Optional[str] = None, max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
                    max_q_len: int = 1) -> int:
    """Bytes of one split-K workspace that serves every layer shape in ``shapes`` at up to
    ``max_batch`` sequences: the largest ``DecodeAttention.workspace_nbytes`` among them.

    ``shapes``: ``(num_q_heads, num_kv_heads, head_dim)`` tuples, or ``(..., v_head_dim)`` where
    values are narrower (MLA: ``(16, 1, 576, 512)``), or ``ModelShape``; the
    other arguments as ``DecodeAttention`` takes them (the target and split-K policy
    decide the split count, and so the size). Allocate it once (any dtype, e.g.
    ``torch.empty(n, dtype=torch.uint8, device="cuda")``) and pass it as ``workspace=``
    to every layer's object: a model of 80 layers of one shape, or of several shapes,
    allocates one workspace. Objects sharing a workspace must not run concurrently (see
    ``DecodeAttention``).
    """
    be = get_backend(backend) if backend is None or isinstance(backend, str) else backend
    max_batch = int_in("max_batch", max_batch, 1)
    max_decode_seqs = int_in("max_decode_seqs", max_decode_seqs, 0)
    max_q_len = int_in("max_q_len", max_q_len, 1, MAX_Q_LEN)
    target_policy = resolve_target_policy(target_for(be.device(), target), splitk=splitk, gqa_pack=None)
    sizes = [workspace_for(target_policy, s if isinstance(s, ModelShape) else ModelShape(*s), max_batch=max_batch,
                           max_decode_seqs=max_decode_seqs, max_q_len=max_q_len).nbytes for s in shapes]
    if not sizes:
        raise ValueError("shapes must name at least one (num_q_heads, num_kv_heads, head_dim)")
    return max(sizes)


def where(device) -> str:
    """A device for a message: ``cuda:N``, or host memory."""
    return "host memory" if device is None else f"cuda:{device}"
