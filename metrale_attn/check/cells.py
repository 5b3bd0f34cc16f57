"""What ``metrale-attn check`` runs: the cells of a check, as plain data (pure; no device).

A check proves the package on one machine for one model. Its work is a list of cells, each
run by one implementation in the worker process of that implementation (``worker.py``):

- a **correctness** cell (``kind="correct"``): one layer kind x KV dtype x arm on a small
  problem of mixed lengths, its output and lse against the float64 reference at the
  package's 1-ulp bar. Ours only (``OURS``); on every backend, the CPU's included.
- a **timing** cell (``kind="time"``): one layer kind x KV dtype x (batch, context) point at
  the policy's default launch, its output checked against float64 on a few sequences, then
  timed (CUDA-graph replay, L2 flushed) against the copy bandwidth measured in the same
  process. Ours and the peers (``PEERS``: PyTorch SDPA over gathered KV, FlashInfer); on a GPU
  only.

Implementations run in this order: ours first (the default ``mma`` before the ``simt``
reference), then the peers; an implementation's cells in the order written here (every
correctness cell, then the timing cells by layer, dtype, point), so a run cut short has the
most decisive numbers first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..policy import gqa_pack_shape_ok
from ..precompile import Layer

OURS = ("mma", "simt")
"""Our implementations (``DecodeAttention(impl=...)``), the default first."""
PEERS = ("sdpa", "flashinfer")
"""The peers timed beside ours where they are installed: PyTorch SDPA over KV gathered into a
dense tensor inside the timed call (what a stack without a paged kernel pays), and FlashInfer's
batch decode on the same paged pool."""
IMPLS = OURS + PEERS
KV_DTYPES = ("bf16", "fp8")
"""KV cache dtypes a check takes: bf16, and fp8 e4m3 with a per-tensor scale (q and out bf16)."""
ARMS = ("unpacked", "splitk", "gqa_packed")
ARM_OPTIONS = {
    "unpacked": dict(splitk="off", gqa_pack=False),
    "splitk": dict(splitk="auto", gqa_pack=False),
    "gqa_packed": dict(splitk="off", gqa_pack=True),
}
"""The ``DecodeAttention`` options that force each arm (the policy's gates still decide whether
the forced arm applies: a cell records the arm its plan ran)."""
POINTS = ((1, 4096), (16, 4096), (64, 4096), (1, 32768))
"""(batch, context) of the timing cells: the serving regimes, few sequences to a full batch,
and one long sequence (where split-K decides)."""
CORRECT_SEQ_LENS = (1, 37, 300, 777, 1300)
"""Sequence lengths of a correctness cell's problem: an empty-but-one sequence, ragged page
tails, and one long enough for split-K to split (the auto policy's split length is at least 256)."""
PAGE_SIZE = 16


def shape_of(layer: Layer) -> str:
    """``32/8/128``: q heads / KV heads / head dim of one rank."""
    return f"{layer.num_q_heads}/{layer.num_kv_heads}/{layer.head_dim}"


def features_of(layer: Layer) -> dict:
    """``DecodeAttention``'s feature keyword arguments that ``layer`` sets."""
    out = {}
    if layer.window_left >= 0:
        out["window_left"] = layer.window_left
    if layer.logits_soft_cap is not None:
        out["logits_soft_cap"] = layer.logits_soft_cap
    if layer.sinks:
        out["sinks"] = True
    return out


@dataclass(frozen=True)
class Cell:
    """One unit of a check's work, run by ``impl`` (see the module's docstring)."""

    kind: str  # "correct" or "time"
    impl: str
    layer: Layer
    kv_dtype: str
    arm: Optional[str] = None  # correctness: the arm forced
    batch: int = 0  # timing: the point
    context: int = 0

    @property
    def label(self) -> str:
        """``mma 32/8/128 bf16 splitk`` or ``sdpa 32/8/128 fp8 b64x4k``: the name a report and a fault use."""
        shape = shape_of(self.layer)
        named = self.layer.name if self.layer.name == shape else f"{self.layer.name} {shape}"
        head = f"{self.impl} {named} {self.kv_dtype}"
        if self.kind == "correct":
            return f"{head} {self.arm}"
        return f"{head} b{self.batch}x{_k(self.context)}"

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(d: dict) -> "Cell":
        return Cell(**{**d, "layer": Layer(**d["layer"])})


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def arms_for(layer: Layer) -> tuple[str, ...]:
    """The arms a correctness cell forces for ``layer``: unpacked and split-K always; the GQA pack
    where the policy's shape gate lets it serve the layer (``policy.gqa_pack_shape_ok``)."""
    packed = gqa_pack_shape_ok(layer.num_q_heads, layer.num_kv_heads, layer.head_dim)
    return ("unpacked", "splitk", "gqa_packed") if packed else ("unpacked", "splitk")


def plan_cells(layers: Sequence[Layer], kv_dtypes: Sequence[str], impls: Sequence[str], *, timed: bool,
               correctness: bool = True, points: Sequence[tuple[int, int]] = POINTS) -> list[Cell]:
    """Every cell of a check, in the order they run (ours first; see the module's docstring).

    ``timed``: whether timing cells exist (a GPU); ``correctness``: whether correctness cells do
    (a peer has none). A peer's timing cells skip layers with features it cannot serve the way
    ours does (``peer_refusal``): those are reported as unavailable, not run."""
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {', '.join(unknown)}")
    bad = [d for d in kv_dtypes if d not in KV_DTYPES]
    if bad:
        raise ValueError(f"kv_dtypes must be among {', '.join(KV_DTYPES)}, got {', '.join(bad)}")
    order = [i for i in IMPLS if i in impls]
    cells = []
    for impl in order:
        if correctness and impl in OURS:
            cells += [Cell("correct", impl, layer, kv, arm=arm) for layer in layers for kv in kv_dtypes
                      for arm in arms_for(layer)]
        if timed:
            cells += [Cell("time", impl, layer, kv, batch=b, context=t) for layer in layers for kv in kv_dtypes
                      for b, t in points]
    return cells


def peer_refusal(cell: Cell) -> Optional[str]:
    """Why a peer does not run ``cell`` as ours would (None: it does): the peers here compute plain
    causal-free decode, so a layer's window, soft-cap or sinks would make the comparison unfair."""
    features = features_of(cell.layer)
    if cell.impl in OURS or not features:
        return None
    return f"{cell.impl} is timed on plain layers only; {cell.layer.name} has {', '.join(features)}"


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """``"64x4096,1x32768"`` -> ((64, 4096), (1, 32768)); a ValueError names ``--points``."""
    points = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            batch, context = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"--points must be BATCHxCONTEXT pairs separated by commas (64x4096,1x32768), "
                             f"got {text!r}") from None
        if batch < 1 or context < 1:
            raise ValueError(f"--points: batch and context must be >= 1, got {part!r}")
        points.append((batch, context))
    if not points:
        raise ValueError(f"--points names no point: {text!r}")
    return tuple(points)
