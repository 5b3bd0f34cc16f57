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

The grid is layers x KV dtypes x points; cells beyond it are named one by one (``--cells
MODEL:KV:BATCHxCONTEXT``, ``parse_cells``): each brings its layer's correctness cells and one
timing cell, so a few wide layers join a check without multiplying into its grid.

A layer the ``mma`` kernels have no kernel of (``mma_runs_simt``: head dim 512, MLA's 576/512)
runs the ``simt`` kernels when ``mma`` is asked, by design: such a layer's cells are planned
under ``mma`` only when both are asked, since the ``simt`` worker would run the same kernels
again.

Implementations run in this order: ours first (the default ``mma`` before the ``simt``
reference), then the peers; an implementation's cells in the order written here (every
correctness cell, then the timing cells by layer, dtype, point), so a run cut short has the
most decisive numbers first.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from ..hf_config import shard_heads
from ..kernels import V_IN_K_KV_DTYPES, mma_shape_refusal_of
from ..models import model_shape
from ..policy import gqa_pack_shape_ok
from ..precompile import Layer, layer_shape, preset_layer, v_head_dim_of

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
    """``32/8/128``: q heads / KV heads / head dim of one rank (``16/1/576/512``: and the value width,
    where narrower)."""
    narrow = f"/{layer.v_head_dim}" if v_head_dim_of(layer) != layer.head_dim else ""
    return f"{layer.num_q_heads}/{layer.num_kv_heads}/{layer.head_dim}{narrow}"


def mma_runs_simt(layer: Layer) -> Optional[str]:
    """Why an ``mma`` request of ``layer`` runs the ``simt`` kernels on every device (the mma core
    has no kernel of its shape: ``kernels.mma_shape_refusal``), or None. Not a fallback: no
    self-test decides it, and the construction says so."""
    return mma_shape_refusal_of(layer_shape(layer))


def reads_v_from_k(layer: Layer, kv_dtype: str, impl: str) -> bool:
    """Whether ``impl`` reads a call's V from the K rows it has already loaded: ours where the
    layer's V is the first ``v_head_dim`` dims of each K row (``v_in_k``, MLA; the check's
    ``v_cache`` is then ``k_cache[..., :v_head_dim]``) on a cache dtype the ``v_in_k`` kernels
    serve (``kernels.V_IN_K_KV_DTYPES``: bf16). That is ``binding.CallBinder._v_in_k``'s rule on
    the check's arrays (same pointer, dtype, device and strides); other caches read V on their own."""
    return impl in OURS and layer.v_in_k and kv_dtype in V_IN_K_KV_DTYPES


def cache_bytes_per_token(layer: Layer, kv_dtype: str, impl: str) -> int:
    """Bytes ``impl`` reads from the caches per cached token, all KV heads: each head's K row
    (``head_dim`` x itemsize) and its V row (``v_head_dim`` x itemsize), V counted once more only
    where it is read on its own. Where V is K's first dims and the kernel takes it from K's
    registers (``reads_v_from_k``) a token costs its K row alone: MLA bf16 1,152 B (576 x 2),
    against 2,176 B when V is read again (fp8: 576 + 512 = 1,088 B, the ``v_in_k`` kernels being
    bf16's only). The peers gather K and V apart, so they read both. This is what % of copy
    divides by: bytes actually read, not bytes the model holds."""
    itemsize = 1 if kv_dtype == "fp8" else 2
    v_dims = 0 if reads_v_from_k(layer, kv_dtype, impl) else v_head_dim_of(layer)
    return layer.num_kv_heads * (layer.head_dim + v_dims) * itemsize


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


@dataclass(frozen=True)
class Named:
    """A cell named on the command line (``--cells``): one layer at one KV dtype and one point."""

    layer: Layer
    kv_dtype: str
    batch: int
    context: int


def arms_for(layer: Layer) -> tuple[str, ...]:
    """The arms a correctness cell forces for ``layer``: unpacked and split-K always; the GQA pack
    where the policy's shape gate lets it serve the layer (``policy.gqa_pack_shape_ok``)."""
    packed = gqa_pack_shape_ok(layer.num_q_heads, layer.num_kv_heads, layer.head_dim)
    return ("unpacked", "splitk", "gqa_packed") if packed else ("unpacked", "splitk")


def plan_cells(layers: Sequence[Layer], kv_dtypes: Sequence[str], impls: Sequence[str], *, timed: bool,
               correctness: bool = True, points: Sequence[tuple[int, int]] = POINTS,
               named: Sequence[Named] = ()) -> list[Cell]:
    """Every cell of a check, in the order they run (ours first; see the module's docstring).

    ``timed``: whether timing cells exist (a GPU); ``correctness``: whether correctness cells do
    (a peer has none). The grid (``layers`` x ``kv_dtypes`` x ``points``) comes first, then the
    ``named`` cells: their layers' correctness cells (each layer and dtype once) and one timing
    cell each. A layer whose ``mma`` request runs ``simt`` (``mma_runs_simt``) has no ``simt``
    cells when ``mma`` is asked too. A peer's timing cells skip layers with features it cannot
    serve the way ours does (``peer_refusal``): those are reported as unavailable, not run."""
    unknown = [i for i in impls if i not in IMPLS]
    if unknown:
        raise ValueError(f"impls must be among {', '.join(IMPLS)}, got {', '.join(unknown)}")
    bad = [d for d in (*kv_dtypes, *(n.kv_dtype for n in named)) if d not in KV_DTYPES]
    if bad:
        raise ValueError(f"kv_dtypes must be among {', '.join(KV_DTYPES)}, got {', '.join(bad)}")
    order = [i for i in IMPLS if i in impls]
    checked = list(dict.fromkeys([(layer, kv) for layer in layers for kv in kv_dtypes]
                                 + [(n.layer, n.kv_dtype) for n in named]))
    cells = []
    for impl in order:
        if correctness and impl in OURS:
            cells += [Cell("correct", impl, layer, kv, arm=arm) for layer, kv in checked for arm in arms_for(layer)]
        if timed:
            cells += [Cell("time", impl, layer, kv, batch=b, context=t) for layer in layers for kv in kv_dtypes
                      for b, t in points]
            cells += [Cell("time", impl, n.layer, n.kv_dtype, batch=n.batch, context=n.context) for n in named]
    if "mma" in order:  # the simt worker would run the very kernels the mma one ran
        cells = [c for c in cells if not (c.impl == "simt" and mma_runs_simt(c.layer))]
    return cells


FLASHINFER_DECODE_HEAD_DIMS = (64, 128, 256)
"""Head dims FlashInfer's batch decode (``BatchDecodeWithPagedKVCacheWrapper``) is built for on
every architecture this check runs on: one width for K and V (512 on sm_12x only, issue 32)."""


def peer_refusal(cell: Cell) -> Optional[str]:
    """Why a peer does not run ``cell`` as ours would (None: it does): the peers here compute plain
    causal-free decode, so a layer's window, soft-cap or sinks would make the comparison unfair;
    and FlashInfer's batch decode takes neither values narrower than keys (MLA is another API of
    its own, ``BatchMLAPagedAttentionWrapper``, over another cache layout) nor a head dim past 256."""
    if cell.impl in OURS:
        return None
    features = features_of(cell.layer)
    if features:
        return f"{cell.impl} is timed on plain layers only; {cell.layer.name} has {', '.join(features)}"
    layer = cell.layer
    if cell.impl == "flashinfer" and v_head_dim_of(layer) != layer.head_dim:
        return (f"flashinfer's batch decode takes one head dim for K and V; {layer.name} is MLA's absorbed "
                f"{layer.head_dim}/{v_head_dim_of(layer)} (FlashInfer's MLA decode, BatchMLAPagedAttentionWrapper, "
                "is another API over another cache layout, not wired here)")
    if cell.impl == "flashinfer" and layer.head_dim not in FLASHINFER_DECODE_HEAD_DIMS:
        return (f"flashinfer's batch decode is built for head dims {', '.join(map(str, FLASHINFER_DECODE_HEAD_DIMS))}"
                f" here, not {layer.head_dim} (512 only on sm_12x)")
    return None


def parse_cells(text: str, tensor_parallel: int = 1) -> tuple[Named, ...]:
    """``"deepseek-v3:bf16:64x4096,gemma-4-26b-global:bf16:64x4096"`` -> the cells named, each
    ``MODEL:KV:BATCHxCONTEXT`` with MODEL a ``--model`` preset or shape (``models.model_shape``:
    ``16/1/576/512`` too) at one rank of ``tensor_parallel``; a ValueError names ``--cells``."""
    form = "MODEL:KV:BATCHxCONTEXT items separated by commas (deepseek-v3:bf16:64x4096)"
    named = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        fields = part.split(":")
        if len(fields) != 3:
            raise ValueError(f"--cells takes {form}; got {part!r}")
        name, kv, point = fields
        if kv not in KV_DTYPES:
            raise ValueError(f"--cells {part}: the KV dtype must be one of {', '.join(KV_DTYPES)}, got {kv!r}")
        try:
            whole = model_shape(name)
            q, kv_heads = shard_heads(whole.num_q_heads, whole.num_kv_heads, tensor_parallel)
            batch, context = _point(point)
        except ValueError as err:
            raise ValueError(f"--cells {part}: {err}") from None
        named.append(Named(preset_layer(name, whole, q, kv_heads), kv, batch, context))
    if not named:
        raise ValueError(f"--cells names no cell: {text!r} (it takes {form})")
    return tuple(named)


def parse_points(text: str) -> tuple[tuple[int, int], ...]:
    """``"64x4096,1x32768"`` -> ((64, 4096), (1, 32768)); a ValueError names ``--points``."""
    points = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            points.append(_point(part))
        except ValueError as err:
            raise ValueError(f"--points must be BATCHxCONTEXT pairs separated by commas (64x4096,1x32768), got "
                             f"{text!r}: {err}") from None
    if not points:
        raise ValueError(f"--points names no point: {text!r}")
    return tuple(points)


def _point(part: str) -> tuple[int, int]:
    """``"64x4096"`` -> (64, 4096); else a ValueError saying what it takes."""
    try:
        batch, context = (int(x) for x in part.lower().split("x"))
    except ValueError:
        raise ValueError(f"a point is BATCHxCONTEXT (64x4096), got {part!r}") from None
    if batch < 1 or context < 1:
        raise ValueError(f"batch and context must be >= 1, got {part!r}")
    return batch, context
