"""Launch plans: the geometry of one decode call, as a pure function of configuration.

policy (rules) -> plan (this module: implementation, arm, split count, heads per
CTA, work items, the CTAs launched, workspace) -> kernels (what to compile) -> launch (backends). A plan is
frozen and cheap; ``DecodeAttention`` memoizes one per batch size. Dispatch rule:
one split -> the GQA-packed kernel if the pack is on and the shape fits, else the unpacked
kernel; more -> split-K, then merge. The split count comes from the launch policy
alone; ``heads_per_cta`` from ``heads_per_cta_for``, which may read the batch
because a head's bytes do not depend on which heads share its CTA. The rules and
their worked numbers: docs/launch-policy.md.

A *work item* is what one CTA computes at a time: the query heads of one KV head that
share a CTA, of one sequence (its ``q_len`` query tokens; ``simt``: one query token, a work item
per token), over one split of its keys. A kernel's grid of items is what
the arm's indexing names (``KernelGrid``); every kernel launches one CTA per item but the
``mma`` attention kernel, whose persistent CTAs, as many as the SMs hold, walk its items
(``DecodePlan.ctas``, computed here and nowhere else).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from . import policy
from .config import DEFAULT_IMPL, ROW_TILE, LayerConfig, ModelShape, heads_per_cta_choices, max_rows_per_cta
from .targets import Target, TargetPolicy
from .tiling import Tiling, mma_tiling, resident_ctas

ARMS = ("unpacked", "splitk", "gqa_packed")
FP32_BYTES = 4

KERNELS = {
    ("mma", "unpacked"): ("decode_unpacked",),
    ("mma", "splitk"): ("decode_splitk", "decode_splitk_merge"),
    ("mma", "gqa_packed"): ("decode_gqa_packed",),
    ("simt", "unpacked"): ("simt_decode_unpacked",),
    ("simt", "splitk"): ("simt_decode_splitk", "simt_decode_splitk_merge"),
    ("simt", "gqa_packed"): ("simt_decode_gqa_packed",),
}
"""(impl, arm) -> the ``extern "C"`` kernels a plan launches, in order (their sources:
``sources.SOURCE_FILES``; tests check that each source defines them)."""

MIN_ITEMS_PER_SM = 0.5
"""``heads_per_cta_for`` keeps at least this many attention work items per SM. One CTA
keeps 4 warps x 2 stages x 8 KiB = 64 KiB of K/V loads in flight; by Little's law at 800 ns
that sustains ~80 GB/s, so the 4.3 TB/s of an H200 needs ~54 busy CTAs: half of its
132 SMs, with margin. Below that, smaller groups buy items (each KV row is then read
once per group of the KV head instead of once)."""


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


MAX_GRID = (2**31 - 1, 65535, 65535)
"""CUDA's limit on each grid dimension (every compute capability the targets have)."""


@dataclass(frozen=True)
class KernelGrid:
    """One kernel launch of a plan: the ``extern "C"`` name and its 3-D grid of work items
    (x fastest), within ``MAX_GRID`` (a grid past it is refused when the plan is made: a GPU
    would refuse the launch). One CTA serves one item, except in the ``mma`` attention
    kernel (``DecodePlan.launch_grid``)."""

    kernel: str
    grid: tuple[int, int, int]

    def __post_init__(self) -> None:
        over = [f"{axis} = {n} > {limit}" for axis, n, limit in zip("xyz", self.grid, MAX_GRID) if n > limit]
        if over:
            raise GridTooLarge(f"the {self.kernel} grid {self.grid} is past CUDA's limits ({', '.join(over)}): "
                               "lower max_batch (rows are sequences x query tokens) or max_q_len")

    @property
    def items(self) -> int:
        x, y, z = self.grid
        return x * y * z


@dataclass(frozen=True)
class DecodePlan:
    """Geometry of one decode call of ``num_seqs`` sequences.

    ``slots_used`` workspace slots are written (0 off the split arm); the
    workspace itself holds ``workspace.slots``. ``ctas``: the CTAs the attention kernel
    launches (``persistent_ctas``: at most one per item).
    """

    arm: str
    num_seqs: int
    num_splits: int
    launches: tuple[KernelGrid, ...]
    workspace: Workspace
    slots_used: int
    reason: str
    impl: str = DEFAULT_IMPL
    heads_per_cta: int = 1
    q_len: int = 1
    ctas: int = 0

    @property
    def row_tiles(self) -> int:
        """Query-row tiles the ``mma`` kernel needs (1 for ``simt``): a CTA holds
        ``heads_per_cta x q_len`` rows."""
        return self.row_tiles_for(self.heads_per_cta * self.q_len)

    def row_tiles_for(self, rows: int) -> int:
        """Row tiles of ``ROW_TILE`` rows that hold ``rows`` query rows on this plan's implementation."""
        return row_tiles_for(self.impl, rows)

    @property
    def items(self) -> int:
        """Work items of the attention kernel (the first launch)."""
        return self.launches[0].items

    def items_per_sm(self, sm_count: int) -> float:
        """Attention work items per SM: below 1 the device is partly idle."""
        return self.items / max(sm_count, 1)

    def launch_grid(self, i: int) -> tuple[int, int, int]:
        """The grid launch ``i`` starts: ``(ctas, 1, 1)`` persistent CTAs for the ``mma``
        attention kernel, the grid of items (one CTA each) for every other."""
        return (self.ctas, 1, 1) if i == 0 and self.impl == "mma" else self.launches[i].grid


def row_tiles_for(impl: str, rows: int) -> int:
    """Row tiles of ``ROW_TILE`` rows that hold ``rows`` query rows (``simt``: 1)."""
    return 1 if impl == "simt" else -(-rows // ROW_TILE)


class WorkspaceTooSmall(ValueError):
    """A launch would write past the split-K workspace it was given."""


class GridTooLarge(ValueError):
    """A plan's grid has more blocks in a dimension than CUDA launches."""


LEGACY_MAX_DECODE_SEQS = 1
"""Default floor of legacy's reference batch. With 1, ``legacy`` sizes for the batch
actually launched (the classic fill-the-SMs rule, which moves with the batch);
a serving loop may pass its configured decode batch instead."""


def workspace_for(
    target_policy: TargetPolicy, shape: ModelShape, *, max_batch: int, max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS,
    max_q_len: int = 1,
) -> Workspace:
    """The workspace ``DecodeAttention`` allocates once: ``workspace_slots`` with
    ``max_rows = max_batch x max_q_len`` and ``rows_per_seq = max_q_len`` (a query token of
    a multi-token call is a row of its own; legacy: ``sm_count`` slots a query token,
    whatever the batch). A size the policy's saturating 32-bit count cannot hold is a
    ValueError naming ``max_batch``, never a workspace of ``2**32 - 1`` slots."""
    ref = policy.split_ref_seqs(max_batch, max_decode_seqs)
    slots = policy.workspace_slots(target_policy.splitk, target_policy.sm_count, shape.num_q_heads,
                                   max_batch * max_q_len, ref, max_q_len)
    if slots >= policy.U32_MAX:  # saturated: the policy's unsigned 32-bit count cannot say the size
        splits = policy.num_splits(target_policy.splitk, target_policy.sm_count, shape.num_q_heads, ref)
        need = max_batch * max_q_len * shape.num_q_heads * splits
        raise ValueError(f"max_batch={max_batch} is too large: {max_batch} seqs x {max_q_len} query token(s) x "
                         f"{shape.num_q_heads} q heads x {splits} splits = {need} split-K workspace slots, past the "
                         f"{policy.U32_MAX} (2**32 - 1) the launch policy counts "
                         f"({Workspace(need, shape.v_head_dim).nbytes} bytes): lower max_batch")
    return Workspace(slots, shape.v_head_dim)


def persistent_ctas(tiling: Tiling, target: Target) -> int:
    """The CTAs a persistent launch of ``tiling`` starts on ``target``: as many as its SMs
    hold at once (``tiling.resident_ctas`` x ``sm_count``), so none waits for another to
    exit before it starts, and each walks its share of the items. A function of the target
    and the tiling only, never of the batch."""
    return resident_ctas(tiling, target.smem_per_block) * target.sm_count


def attention_ctas(config: LayerConfig, items: int, row_tiles: int) -> int:
    """The CTAs the attention kernel launches for ``items`` work items: ``simt`` one per
    item; ``mma`` min(items, ``persistent_ctas``) (one per item where no tiling of the
    shape fits the target, which ``kernels.mma_refusal`` refuses before any launch)."""
    tiling = mma_tiling(config.shape.head_dim, config.q_dtype, config.kv_dtype, row_tiles,
                        config.target.smem_per_block) if config.impl == "mma" else None
    return items if tiling is None else min(items, persistent_ctas(tiling, config.target))


def heads_per_cta_for(shape: ModelShape, num_seqs: int, num_splits: int, sm_count: int, q_len: int = 1) -> int:
    """Query heads per ``mma`` CTA: the largest divisor of the group size G (at most
    ``config.max_rows_per_cta`` / ``q_len``) whose grid, ``num_kv_heads * (G / h) * num_splits *
    num_seqs`` items, still gives ``MIN_ITEMS_PER_SM`` per SM; 1 when none does.

    Larger is better as long as the device stays covered: each KV row is read once
    per item, so G / h items read every row of a group. Worked numbers on 132 SMs (at
    least 66 items), ``auto`` splits:

    * Llama-3-8B (32/8, G = 4, 9 splits), one sequence: h = 4 gives 8 x 1 x 9 = 72
      items: 4. Any batch: 4.
    * Llama-3-70B (64/8, G = 8, 5 splits), one sequence: h = 8 gives 40 items, h = 4
      gives 80: 4. Two sequences: 80 items at h = 8: 8.
    * 24/4/256 (G = 6, 11 splits), one sequence: 44 items at 6, 88 at 3: 3; from two
      sequences on: 6.
    * Llama-3-8B with split-K off (one split), batch 8: 64 items at 4, 128 at 2: 2;
      from batch 9 on: 4.

    With ``q_len`` query tokens per sequence a CTA holds ``h x q_len`` rows, so ``h``
    is at most ``max_rows_per_cta(head_dim) / q_len``.

    The batch may move this choice (unlike the split count) because a head's output
    bytes do not depend on which heads share its CTA.
    """
    need = math.ceil(MIN_ITEMS_PER_SM * max(sm_count, 1))
    choices = heads_per_cta_choices(shape.group_size, q_len, max_rows_per_cta(shape.head_dim))
    for h in reversed(choices):
        if shape.num_kv_heads * (shape.group_size // h) * num_splits * num_seqs >= need:
            return h
    return choices[0]


def make_plan(config: LayerConfig, num_seqs: int, q_len: int = 1, *, workspace: Optional[Workspace] = None,
              ) -> DecodePlan:
    """Plan a call of ``num_seqs`` sequences (``0 <= num_seqs <= config.max_batch``) of
    ``q_len`` query tokens each (``1 <= q_len <= config.max_q_len``) for a layer.

    ``legacy`` reads ``split_ref_seqs(num_seqs, max_decode_seqs)``; ``auto`` and
    pinned policies read neither, which is the batch-invariance guarantee.
    ``config.heads_per_cta`` (``mma`` only) overrides ``heads_per_cta_for``. The packed
    arm always serves ``DECODE_GQA_PACK_WIDTH`` heads per CTA, and ``simt`` one (its
    packed arm: the pack). Each query token is a row of its own in the workspace and
    the merge (and, on ``simt``, a work item of its own in the attention grid, whose sequences
    axis is then ``num_seqs x q_len``); the packed arm serves ``q_len = 1`` only.

    ``workspace`` is what was allocated (default: ``workspace_for`` the config); a
    split-K geometry that needs more slots is refused here, with both sizes, because on
    the GPU it would be a silent out-of-bounds write. The config's values are taken as
    checked (``config.configure``); only the call's own two numbers are checked here.
    """
    seqs = policy.as_int(num_seqs)  # NumPy integers too, not bools
    if seqs is None or not 0 <= seqs <= config.max_batch:
        raise ValueError(f"num_seqs must be an int in 0..max_batch={config.max_batch}, got {num_seqs!r}")
    tokens = policy.as_int(q_len)
    if tokens is None or not 1 <= tokens <= config.max_q_len:
        raise ValueError(f"q_len must be an int in 1..max_q_len={config.max_q_len}, got {q_len!r}")
    q_len = tokens
    num_seqs, target_policy, shape, impl = seqs, config.target_policy, config.shape, config.impl
    if workspace is None:
        workspace = workspace_for(target_policy, shape, max_batch=config.max_batch, max_decode_seqs=config.max_decode_seqs,
                                  max_q_len=config.max_q_len)
    max_decode_seqs, heads_per_cta = config.max_decode_seqs, config.heads_per_cta
    sms, heads = target_policy.sm_count, shape.num_q_heads
    ref = policy.split_ref_seqs(num_seqs, max_decode_seqs)
    splits = policy.num_splits(target_policy.splitk, sms, heads, ref)
    why = _why_splits(target_policy, heads, ref, splits)

    pack_fits = policy.gqa_pack_shape_ok(shape.num_q_heads, shape.num_kv_heads, shape.head_dim) and q_len == 1
    if splits == 1 and target_policy.gqa_pack and pack_fits:
        hpc, why_h = policy.DECODE_GQA_PACK_WIDTH, "the pack"
    elif impl == "simt":
        hpc, why_h = 1, "simt: one"
    elif heads_per_cta is not None:
        hpc, why_h = heads_per_cta, "override"
    else:
        hpc = heads_per_cta_for(shape, max(num_seqs, 1), splits, sms, q_len)
        why_h = f"rule (>= {MIN_ITEMS_PER_SM:g} items per SM)"
    why += f"; {impl}: {hpc} head(s) per CTA ({why_h})"
    items_x = heads // hpc
    row_tiles = row_tiles_for(impl, hpc * q_len)
    # The sequences axis of the attention grid: an mma CTA holds a sequence's q_len tokens as rows of
    # its own; a simt CTA serves one query row, so it is (sequence, token), seq-major (simt_core.cuh).
    seq_items = num_seqs * q_len if impl == "simt" else num_seqs

    if splits > 1:
        needed = num_seqs * q_len * heads * splits
        if needed > workspace.slots:
            tokens = f" x {q_len} query tokens" if q_len > 1 else ""
            raise WorkspaceTooSmall(
                f"split-K workspace too small: {num_seqs} seqs{tokens} x {heads} q heads x {splits} splits need "
                f"{needed} slots ({needed * workspace.slot_floats * FP32_BYTES} bytes), but the workspace "
                f"holds {workspace.slots} slots ({workspace.nbytes} bytes)"
            )
        launches = (
            KernelGrid(KERNELS[impl, "splitk"][0], (items_x, splits, seq_items)),
            KernelGrid(KERNELS[impl, "splitk"][1], (heads, num_seqs * q_len, 1)),
        )
        return DecodePlan("splitk", num_seqs, splits, launches, workspace, needed, why + "; split-K then merge",
                          impl, hpc, q_len, attention_ctas(config, launches[0].items, row_tiles))

    if target_policy.gqa_pack and pack_fits:
        grid = KernelGrid(KERNELS[impl, "gqa_packed"][0], (shape.num_kv_heads, num_seqs, 1))
        assert grid.items == policy.gqa_pack_ctas(shape.num_kv_heads, num_seqs)
        return DecodePlan("gqa_packed", num_seqs, 1, (grid,), workspace, 0, why + "; GQA pack on and shape fits",
                          impl, hpc, q_len, attention_ctas(config, grid.items, row_tiles))
    if target_policy.gqa_pack:
        why += (
            f"; GQA pack on but the shape does not fit (needs q_heads = kv_heads x "
            f"{policy.DECODE_GQA_PACK_WIDTH} at head_dim {policy.DECODE_GQA_PACK_HEAD_DIM}, one query token)"
        )
    grid = KernelGrid(KERNELS[impl, "unpacked"][0], (items_x, seq_items, 1))
    return DecodePlan("unpacked", num_seqs, 1, (grid,), workspace, 0, why + "; unpacked", impl, hpc, q_len,
                      attention_ctas(config, grid.items, row_tiles))


def _why_splits(target_policy: TargetPolicy, heads: int, ref: int, splits: int) -> str:
    p, sms = target_policy.splitk, target_policy.sm_count
    if p.kind == "auto":
        return (
            f"auto: ceil({policy.SPLITK_TARGET_WAVES} x {sms} SMs / {heads} q heads) "
            f"clamped to 1..{policy.MAX_DECODE_SPLITS} = {splits} split(s)"
        )
    if p.kind == "legacy":
        return f"legacy: {heads} q heads x {ref} ref seqs vs {sms} SMs = {splits} split(s)"
    return f"pinned: {splits} split(s)"
