"""Launch plans: the geometry of one decode call, as a pure function of configuration.

policy (rules) -> plan (this module: arm, split count, grids, workspace) -> launch
(backends). A plan is frozen and cheap; ``DecodeAttention`` memoizes one per
batch size. Dispatch rule: one split -> the GQA-packed kernel if armed and the
shape fits, else the unpacked kernel; more -> split-K, then merge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import policy
from .targets import Defaults

ARMS = ("unpacked", "gqa_packed", "splitk")
HEAD_DIMS = (64, 128, 256)
FP32_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """Attention heads of one layer. ``num_q_heads`` is a multiple of ``num_kv_heads``."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        for name in ("num_q_heads", "num_kv_heads", "head_dim"):
            value = policy.as_int(getattr(self, name))  # NumPy integers too, not bools
            if value is None or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads ({self.num_q_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim not in HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads


@dataclass(frozen=True)
class Workspace:
    """The split-K workspace: ``slots`` x ``[o[head_dim], m, l]`` fp32 values."""

    slots: int
    head_dim: int

    @property
    def slot_floats(self) -> int:
        return self.head_dim + 2

    @property
    def nbytes(self) -> int:
        return self.slots * self.slot_floats * FP32_BYTES


@dataclass(frozen=True)
class KernelGrid:
    """One kernel launch of a plan: the ``extern "C"`` name and its 3-D grid."""

    kernel: str
    grid: tuple[int, int, int]

    @property
    def ctas(self) -> int:
        x, y, z = self.grid
        return x * y * z


@dataclass(frozen=True)
class DecodePlan:
    """Geometry of one decode call of ``num_seqs`` sequences.

    ``slots_used`` workspace slots are written (0 off the split arm); the
    workspace itself holds ``workspace.slots``.
    """

    arm: str
    num_seqs: int
    num_splits: int
    launches: tuple[KernelGrid, ...]
    workspace: Workspace
    slots_used: int
    reason: str

    @property
    def ctas(self) -> int:
        """CTAs of the attention kernel (the first launch)."""
        return self.launches[0].ctas

    def waves(self, sm_count: int) -> float:
        """Attention CTAs per SM: below 1 the device is partly idle."""
        return self.ctas / max(sm_count, 1)


class WorkspaceTooSmall(ValueError):
    """A launch would write past the split-K workspace it was given."""


LEGACY_MAX_DECODE_SEQS = 1
"""Default floor of legacy's reference batch. With 1, ``legacy`` sizes for the batch
actually launched (the classic fill-the-SMs rule, which moves with the batch);
a serving loop may pass its configured decode batch instead."""


def workspace_for(
    defaults: Defaults, shape: ModelShape, *, max_batch: int, max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS
) -> Workspace:
    """The workspace ``DecodeAttention`` allocates once: ``workspace_slots`` with
    ``max_rows = max_batch`` (legacy: ``sm_count`` slots, whatever the batch)."""
    ref = policy.split_ref_seqs(max_batch, max_decode_seqs)
    slots = policy.workspace_slots(defaults.splitk, defaults.sm_count, shape.num_q_heads, max_batch, ref)
    return Workspace(slots, shape.head_dim)


def make_plan(
    defaults: Defaults,
    shape: ModelShape,
    num_seqs: int,
    *,
    max_batch: int,
    max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
    workspace: Optional[Workspace] = None,
) -> DecodePlan:
    """Plan a call of ``num_seqs`` sequences (``0 <= num_seqs <= max_batch``).

    ``legacy`` reads ``split_ref_seqs(num_seqs, max_decode_seqs)``; ``auto`` and
    pinned policies read neither, which is the batch-invariance guarantee.

    ``workspace`` is what was allocated (default: ``workspace_for`` the same
    arguments); a split-K geometry that needs more slots is refused here, with
    both sizes, because on the GPU it would be a silent out-of-bounds write.
    """
    batch, seqs = policy.as_int(max_batch), policy.as_int(num_seqs)  # NumPy integers too, not bools
    if batch is None or batch < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {max_batch!r}")
    if seqs is None or not 0 <= seqs <= batch:
        raise ValueError(f"num_seqs must be an int in 0..max_batch={batch}, got {num_seqs!r}")
    max_batch, num_seqs = batch, seqs
    if workspace is None:
        workspace = workspace_for(defaults, shape, max_batch=max_batch, max_decode_seqs=max_decode_seqs)
    sms, heads = defaults.sm_count, shape.num_q_heads
    ref = policy.split_ref_seqs(num_seqs, max_decode_seqs)
    splits = policy.num_splits(defaults.splitk, sms, heads, ref)
    why = _why_splits(defaults, heads, ref, splits)

    if splits > 1:
        needed = num_seqs * heads * splits
        if needed > workspace.slots:
            raise WorkspaceTooSmall(
                f"split-K workspace too small: {num_seqs} seqs x {heads} q heads x {splits} splits need "
                f"{needed} slots ({needed * workspace.slot_floats * FP32_BYTES} bytes), but the workspace "
                f"holds {workspace.slots} slots ({workspace.nbytes} bytes)"
            )
        launches = (
            KernelGrid("paged_decode_splitk", (heads, splits, num_seqs)),
            KernelGrid("paged_decode_splitk_merge", (heads, num_seqs, 1)),
        )
        return DecodePlan("splitk", num_seqs, splits, launches, workspace, needed, why + "; split-K then merge")

    pack_fits = policy.gqa_pack_shape_ok(shape.num_q_heads, shape.num_kv_heads, shape.head_dim)
    if defaults.gqa_pack and pack_fits:
        grid = KernelGrid("paged_decode_gqa_packed", (shape.num_kv_heads, num_seqs, 1))
        assert grid.ctas == policy.gqa_pack_ctas(shape.num_kv_heads, num_seqs)
        return DecodePlan("gqa_packed", num_seqs, 1, (grid,), workspace, 0, why + "; GQA pack armed and shape fits")
    if defaults.gqa_pack:
        why += (
            f"; GQA pack armed but the shape does not fit (needs q_heads = kv_heads x "
            f"{policy.DECODE_GQA_PACK_WIDTH} at head_dim {policy.DECODE_GQA_PACK_HEAD_DIM})"
        )
    grid = KernelGrid("paged_decode_unpacked", (heads, num_seqs, 1))
    return DecodePlan("unpacked", num_seqs, 1, (grid,), workspace, 0, why + "; unpacked")


def _why_splits(defaults: Defaults, heads: int, ref: int, splits: int) -> str:
    p, sms = defaults.splitk, defaults.sm_count
    if p.kind == "auto":
        return (
            f"auto: ceil({policy.SPLITK_TARGET_WAVES} x {sms} SMs / {heads} q heads) "
            f"clamped to 1..{policy.MAX_DECODE_SPLITS} = {splits} split(s)"
        )
    if p.kind == "legacy":
        return f"legacy: {heads} q heads x {ref} ref seqs vs {sms} SMs = {splits} split(s)"
    return f"pinned: {splits} split(s)"
