"""The vLLM v1 attention backend: ``MetraleAttentionBackend``, its metadata builder and its impl.

What routes where is in the package's first lines (``metrale_attn.integrations.vllm``).
The pieces, in the order vLLM meets them:

* ``MetraleAttentionBackend``: what vLLM asks before it selects a backend. Every
  refusal is made here (``supports_*``, ``supports_combination``), so vLLM falls back or
  stops with our reason, never at a forward, naming the value and what works
  (``validate_configuration``, ``options.selection_refusals``); the impl refuses what the
  selector cannot see (ALiBi, a logits soft-cap below 0).
* ``MetraleAttentionImpl``: one per attention layer. At model construction it maps the
  layer's arguments onto ``DecodeAttention`` options (``options``), builds vLLM's own
  prefill impl for the same layer, and reserves the layer's shape in the model's
  ``ModelAttention``, whose one split-K workspace is allocated from torch when the
  weights are loaded, before vLLM profiles memory for the KV cache.
* ``MetraleMetadataBuilder``: one per KV cache group, built once the KV cache block
  size is known. It builds each layer's ``DecodeAttention`` (page size = the group's
  kernel block size), and per step splits the batch and builds the prefill backend's
  metadata for the prefill requests only.
* ``MetraleAttentionImpl.forward``: decodes through ``ModelAttention.decode`` (the op
  ``torch.ops.metrale_attn.paged_decode``) on views of vLLM's own tensors (q, out, the K
  and V halves of the layer's cache, the block table, seq_lens: no copy), prefills
  through the prefill impl on the rest of the rows.

The KV cache is vLLM's per-layer view, logical ``[blocks, kv_heads, block_size, 2 x
head_size]`` (K then V in the last dim) in any of ``KVCacheLayout``'s physical orders;
``kv_cache[..., :D]`` and ``kv_cache[..., D:]`` are HND caches addressed by strides.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import weakref
from typing import ClassVar, Optional

import numpy as np
import torch
import vllm.envs as envs
from vllm.config import VllmConfig, get_current_vllm_config_or_none, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.platforms import current_platform
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
    max_decode_query_len,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_layout import KVCacheLayout

from ... import policy
from ...logs import follow_vllm
from ...serving import ModelAttention
from ...targets import DEFAULT_TARGET, detect_target, get_target, resolve_target_policy
from . import BACKEND_NAME, options

logger = init_logger(__name__)
follow_vllm()  # vLLM configures only its own logger tree: without this our records never reach its log

KERNEL_BLOCK_SIZES = options.KERNEL_BLOCK_SIZES  # what we offer vLLM for a kernel block: see there

LAYOUTS = (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLNHC, KVCacheLayout.BLHNC,
           KVCacheLayout.BHLNC, KVCacheLayout.LHBNC)
"""Every physical order vLLM 0.33 allocates, in vLLM's default preference: the kernels
address K and V by strides and need only the last dim contiguous, which all have."""


# -- which of vLLM's backends serves the prefill tokens ----------------------------------


def _capability() -> DeviceCapability:
    """This device's capability; without a GPU (the CPU backend), the default target's."""
    found = current_platform.get_device_capability()
    return found if found is not None else DeviceCapability(*get_target(DEFAULT_TARGET).compute_capability)


def prefill_backend(*, head_size: int, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                    block_size: Optional[int] = None, has_sink: bool = False,
                    capability: Optional[DeviceCapability] = None) -> type[AttentionBackend]:
    """vLLM's backend for this configuration's prefill tokens: FlashAttention where it is
    present and takes the configuration with a model-dtype cache; else Triton, which
    also takes an fp8 cache with a bf16/fp16 query, as our decode does (FlashAttention 3
    wants the query quantized to fp8 too, which would move that choice into the layer).
    A ValueError with every candidate's reasons when neither takes it."""
    backend, refused = _prefill_candidates(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                           block_size=block_size, has_sink=has_sink, capability=capability)
    if backend is None:
        raise ValueError(options.prefill_refusal(refused, {}))
    return backend


def _prefill_candidates(*, head_size: int, dtype: torch.dtype, kv_cache_dtype: Optional[str],
                        block_size: Optional[int], has_sink: bool, capability: Optional[DeviceCapability]
                        ) -> tuple[Optional[type[AttentionBackend]], list[tuple[str, list[str]]]]:
    """(the first candidate that takes the configuration, or None; the name and vLLM's reasons
    of each candidate before it that refused), the candidates in ``prefill_backend``'s order."""
    from vllm.v1.attention.backends.fa_utils import is_flash_attn_varlen_func_available
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend

    candidates = [TritonAttentionBackend]
    fp8 = kv_cache_dtype is not None and options.is_fp8(kv_cache_dtype)
    if is_flash_attn_varlen_func_available() and not fp8:
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

        candidates.insert(0, FlashAttentionBackend)
    capability = capability or _capability()
    refused = []
    for backend in candidates:
        reasons = backend.validate_configuration(
            head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size, use_mla=False,
            has_sink=has_sink, use_sparse=False, use_mm_prefix=False, use_per_head_quant_scales=False,
            device_capability=capability, attn_type=AttentionType.DECODER)
        if not reasons:
            return backend, refused
        refused.append((backend.get_name(), list(reasons)))
    return None, refused


def _own_refusals(head_size, dtype, kv_cache_dtype, block_size, device_capability, attn_type=None) -> dict[str, str]:
    """``options.selection_refusals`` of vLLM's arguments (a torch dtype, a ``DeviceCapability``)."""
    capability = None if device_capability is None else (device_capability.major, device_capability.minor)
    return options.selection_refusals(head_size=head_size, dtype=str(dtype), kv_cache_dtype=kv_cache_dtype,
                                      block_size=block_size, capability=capability, attn_type=attn_type)


# -- the backend ---------------------------------------------------------------------------


class MetraleAttentionBackend(AttentionBackend):
    """Decode on metrale-attn, prefill on vLLM's FlashAttention (or Triton) backend."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # fp8_e5m2 is read by our kernels; supports_combination refuses it with the reason.
    supported_kv_cache_dtypes: ClassVar[list[str]] = [*options.KV_CACHE_DTYPES, *options.REFUSED_KV_CACHE_DTYPES]
    forward_includes_kv_cache_update: bool = False

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["MetraleAttentionImpl"]:
        return MetraleAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["MetraleMetadataBuilder"]:
        return MetraleMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list:
        """Ours that the prefill backend takes too, largest first (vLLM picks the largest
        that divides its block and splits the block into kernel blocks of that size)."""
        try:
            fp8 = kv_cache_spec.dtype.itemsize == 1
            partner = prefill_backend(head_size=kv_cache_spec.head_size,
                                      dtype=torch.bfloat16 if fp8 else kv_cache_spec.dtype,
                                      kv_cache_dtype="fp8" if fp8 else None)
        except (AttributeError, ValueError):  # no spec yet, or not ours: selection refuses it
            return list(KERNEL_BLOCK_SIZES)
        theirs = partner.get_supported_kernel_block_sizes(kv_cache_spec)
        return [size for size in KERNEL_BLOCK_SIZES
                if any(size % t.base == 0 if isinstance(t, MultipleOf) else size == t for t in theirs)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        """The library's head sizes, 512 too, on its reference kernels (``options.head_sizes_line``)."""
        return list(options.HEAD_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        return True

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        """Decoder self-attention only: encoder, encoder-only and cross attention are refused."""
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return options.capability_refusal((capability.major, capability.minor)) is None

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """Under ``auto`` and pinned split-K policies (the target's declaration, or
        ``METRALE_ATTN_DECODE_SPLITK``) a sequence's decode bytes do not depend on its
        batch; under ``legacy`` they do. Prefill tokens go to a backend vLLM runs
        batch-invariant itself."""
        return _splitk_policy().kind != "legacy"

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        """The decode/prefill split and a decode's query length are read off the CPU query
        lengths, so adaptive verification (device-trimmed drafts) is refused."""
        return False

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla, has_sink, use_sparse,
                             use_mm_prefix, device_capability) -> Optional[str]:
        """Refusals the single ``supports_*`` checks cannot make: fp8 e5m2 (no prefill
        backend reads it), fp8 on sm_80/86 (no fp8 cvt), and any configuration the prefill
        backend refuses."""
        if kv_cache_dtype in options.REFUSED_KV_CACHE_DTYPES:
            return options.REFUSED_KV_CACHE_DTYPES[kv_cache_dtype]
        capability = None if device_capability is None else (device_capability.major, device_capability.minor)
        fp8 = options.fp8_refusal(kv_cache_dtype, capability)
        if fp8 is not None:
            return fp8
        if use_mla or use_sparse or use_mm_prefix:
            return None  # validate_configuration reports each with its own reason
        partner, refused = _prefill_candidates(head_size=head_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                                               block_size=block_size, has_sink=has_sink, capability=device_capability)
        if partner is not None:
            return None
        # A prefill refusal that only repeats one of ours (block_size 8: Triton's too) is not said twice.
        return options.prefill_refusal(refused, _own_refusals(head_size, dtype, kv_cache_dtype, block_size,
                                                              device_capability))

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks, each of its bare refusals ("head_size not supported") replaced by ours,
        which names the value and what works (``options.selection_refusals``)."""
        reasons = super().validate_configuration(*args, **kwargs)
        given = inspect.signature(super().validate_configuration).bind(*args, **kwargs).arguments
        ours = _own_refusals(given.get("head_size"), given.get("dtype"), given.get("kv_cache_dtype"),
                             given.get("block_size"), given.get("device_capability"), given.get("attn_type"))
        reasons = options.with_what_works(reasons, {**ours, "MLA not supported": options.MLA_ELSEWHERE})
        # What the reference kernels lack at 512: vLLM has no bare reason for it, and
        # supports_combination never sees the window.
        capability = given.get("device_capability")
        wide = options.reference_kernel_refusal(
            head_size=given.get("head_size"), kv_cache_dtype=given.get("kv_cache_dtype"),
            has_sink=bool(given.get("has_sink")), has_sliding_window=bool(given.get("has_sliding_window")),
            capability=None if capability is None else (capability.major, capability.minor))
        return reasons + ([wide] if wide else [])

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return LAYOUTS


def _splitk_policy() -> policy.SplitkPolicy:
    """The split-K policy this process's device runs (declaration or environment)."""
    found = current_platform.get_device_capability()
    if found is None:
        target = get_target(DEFAULT_TARGET)
    else:
        try:
            target = detect_target((found.major, found.minor), 1)
        except ValueError:  # not one of ours: refused by supports_compute_capability
            target = get_target(DEFAULT_TARGET)
    return resolve_target_policy(target).splitk


# -- metadata ------------------------------------------------------------------------------


@dataclasses.dataclass
class MetraleAttentionMetadata:
    """One step's batch, split: decode rows ``[0, num_decodes)`` (``decode_q_len`` tokens
    each, token rows ``[0, num_decodes x decode_q_len)``) for our kernels, the rest for
    the prefill backend (``prefill``: its own metadata over the requests from
    ``num_decodes`` and the token rows from ``prefill_start``; None when there are none).

    ``seq_lens`` and ``block_table`` are views of vLLM's persistent buffers (what a
    captured CUDA graph reads again on replay); ``seq_lens`` counts each request's
    query tokens, as ours do."""

    num_actual_tokens: int
    num_decodes: int
    decode_q_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    prefill_start: int
    prefill: Optional[object] = None


_REQUEST_FIELDS = ("seq_lens", "block_table_tensor", "encoder_seq_lens", "encoder_seq_lens_cpu", "dcp_local_seq_lens",
                   "dcp_local_seq_lens_cpu_upper_bound", "is_prefilling", "seq_lens_cpu_upper_bound", "req_idx",
                   "rswa_prefix_lens", "replayssm_decode_base_cpu")
_TOKEN_FIELDS = ("slot_mapping", "positions")
_LOCATION_FIELDS = ("query_start_loc", "query_start_loc_cpu")
_DROPPED_FIELDS = ("logits_indices_padded", "num_logits_indices", "max_logits_per_req",
                   "_num_computed_tokens_cache", "_token_to_req_indices_cache")
_DERIVED_FIELDS = ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "causal", "mm_req_doc_ranges")
COMMON_METADATA_FIELDS = _REQUEST_FIELDS + _TOKEN_FIELDS + _LOCATION_FIELDS + _DROPPED_FIELDS + _DERIVED_FIELDS
"""How ``prefill_part`` treats each field of ``CommonAttentionMetadata`` (a test checks
that every field vLLM defines is here, so an upgrade that adds one fails loudly)."""


def prefill_part(cm: CommonAttentionMetadata, num_decodes: int, num_decode_tokens: int) -> CommonAttentionMetadata:
    """``cm`` restricted to its requests from ``num_decodes`` on, whose tokens start at
    row ``num_decode_tokens``: per-request fields sliced, per-token fields sliced, query
    start locations sliced and shifted to start at 0, batch-wide logits indices dropped;
    ``max_seq_len`` kept (an upper bound, which vLLM raises on purpose during capture).
    With no decodes, ``cm`` itself: nothing is allocated."""
    if num_decodes == 0:
        return cm
    sliced = {name: None if (value := getattr(cm, name)) is None else value[num_decodes:] for name in _REQUEST_FIELDS}
    sliced.update({name: None if (value := getattr(cm, name)) is None else value[num_decode_tokens:]
                   for name in _TOKEN_FIELDS})
    sliced.update({name: getattr(cm, name)[num_decodes:] - num_decode_tokens for name in _LOCATION_FIELDS})
    sliced.update({name: None for name in _DROPPED_FIELDS})
    starts = sliced["query_start_loc_cpu"]
    ranges = cm.mm_req_doc_ranges
    return dataclasses.replace(
        cm, **sliced,
        num_reqs=cm.num_reqs - num_decodes,
        num_actual_tokens=cm.num_actual_tokens - num_decode_tokens,
        max_query_len=int((starts[1:] - starts[:-1]).max()),
        causal=cm.causal[num_decodes:] if isinstance(cm.causal, torch.Tensor) else cm.causal,
        mm_req_doc_ranges=None if ranges is None else {r - num_decodes: v for r, v in ranges.items()
                                                       if r >= num_decodes},
    )


def decode_rows(query_start_loc_cpu: torch.Tensor, num_decodes: int, tokens: int) -> tuple[int, int]:
    """``(rows, q_len)`` of the decode part: ``num_decodes`` leading requests of equal query
    length ``q_len`` (vLLM's padding requests, of length 0, only at the end), laid out
    at token rows ``[r x q_len, (r + 1) x q_len)``; ``tokens``: the rows the decode part
    owns (a CUDA-graph bucket's padding tokens included). Padding requests whose rows
    would pass ``tokens`` are dropped; a layout other than this is an error."""
    if not num_decodes:
        return 0, 1
    starts = query_start_loc_cpu.numpy()[:num_decodes + 1]
    lengths = np.diff(starts)
    q_len = max(int(lengths.max()), 1)
    real = int(np.count_nonzero(lengths))
    if not np.array_equal(starts - starts[0], np.minimum(np.arange(num_decodes + 1) * q_len, real * q_len)):
        raise ValueError(f"the decode requests of this batch are not {q_len} query tokens each, padding last: "
                         f"query_start_loc {starts.tolist()}")
    return (num_decodes if num_decodes * q_len <= tokens else real), q_len


class MetraleMetadataBuilder(AttentionMetadataBuilder[MetraleAttentionMetadata]):
    """Builds each layer's ``DecodeAttention`` once, then one step's split metadata.

    CUDA graphs (``get_cudagraph_support``): a uniform decode batch (every request
    ``q_len`` tokens, padding requests of length 0 and seq_len 0) runs our kernels only,
    on vLLM's persistent seq_lens and block table, so a captured graph replays after
    they change in place; a mixed batch runs eagerly (vLLM's piecewise graphs)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """``UNIFORM_BATCH`` when every uniform batch vLLM captures is a decode batch of
        ours: its query length, 1 + the speculative tokens, is our ``decode_q_len``, and no
        micro-batching (DBO) cuts a multi-token request between two halves. Otherwise
        (more than 7 speculative tokens, batch-invariant mode, DBO with verification)
        single-token decode batches only: a verification batch would run the prefill
        backend on metadata sliced per step, which a graph cannot replay."""
        return cudagraph_support(vllm_config)

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size) != kv_cache_spec.head_size:
            raise ValueError(f"{BACKEND_NAME} needs V's head size to equal K's, got {kv_cache_spec.head_size_v} and "
                             f"{kv_cache_spec.head_size}: select another attention backend for this model")
        impls = _our_impls(vllm_config, layer_names)
        if not impls:
            raise ValueError(f"{BACKEND_NAME}: no attention layer of ours among {layer_names}")
        partners = {impl.prefill_backend for impl in impls}
        if len(partners) > 1:
            raise ValueError(f"{BACKEND_NAME}: the layers of one KV cache group would prefill on different backends "
                             f"({', '.join(sorted(p.get_name() for p in partners))})")
        self.prefill_backend = partners.pop()
        self.decode_q_len = impls[0].model.max_q_len
        self.reorder_batch_threshold = self.decode_q_len  # vLLM moves requests this short to the front
        self.prefill_builder = self.prefill_backend.get_builder_cls()(kv_cache_spec, layer_names, vllm_config, device)
        for impl in impls:
            impl.bind(kv_cache_spec.block_size)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> MetraleAttentionMetadata:
        return self._split(common_attn_metadata,
                           lambda part: self.prefill_builder.build(0, part, fast_build=fast_build))

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata) -> MetraleAttentionMetadata:
        """A capture batch is a uniform decode batch (``get_cudagraph_support``): ours alone;
        anything left goes through the prefill builder's own capture build."""
        return self._split(common_attn_metadata, self.prefill_builder.build_for_cudagraph_capture)

    def _split(self, cm: CommonAttentionMetadata, build_prefill) -> MetraleAttentionMetadata:
        num_decodes, num_prefills, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.decode_q_len, require_uniform=True)
        rows, q_len = decode_rows(cm.query_start_loc_cpu, num_decodes, num_decode_tokens)
        prefill = build_prefill(prefill_part(cm, num_decodes, num_decode_tokens)) if num_prefills else None
        return MetraleAttentionMetadata(num_actual_tokens=cm.num_actual_tokens, num_decodes=rows, decode_q_len=q_len,
                                        seq_lens=cm.seq_lens[:rows], block_table=cm.block_table_tensor[:rows],
                                        prefill_start=num_decode_tokens, prefill=prefill)


def _our_impls(vllm_config: VllmConfig, layer_names) -> list["MetraleAttentionImpl"]:
    layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
    return [layer.impl for layer in layers.values() if isinstance(layer.impl, MetraleAttentionImpl)]


# -- one model's ModelAttention per vLLM config --------------------------------------------

_MODELS: dict[int, ModelAttention] = {}
"""``id(vllm_config)`` -> its model's ``ModelAttention`` (a config is unhashable; an entry
goes when its config does)."""


def model_attention(vllm_config: Optional[VllmConfig]) -> ModelAttention:
    """The ``ModelAttention`` of the model ``vllm_config`` describes (one per config: a
    worker process runs one model, and a drafter shares its workspace, running on the
    same stream between the target's layers)."""
    key = id(vllm_config)
    found = _MODELS.get(key)
    if found is None:
        found = _MODELS[key] = ModelAttention(_device(vllm_config), max_batch=_max_batch(vllm_config),
                                              max_q_len=_decode_q_len(vllm_config))
        if vllm_config is not None:
            weakref.finalize(vllm_config, _MODELS.pop, key, None)
    return found


def _device(vllm_config: Optional[VllmConfig]) -> torch.device:
    """The model's device; on a GPU, CuPy must be there to launch our kernels."""
    device = None if vllm_config is None else vllm_config.device_config.device
    device = torch.device(device if device is not None else current_platform.device_type or "cpu")
    if device.type == "cuda":
        if importlib.util.find_spec("cupy") is None:
            raise ValueError(f"{BACKEND_NAME} launches its kernels through CuPy, which is not installed: "
                             "pip install 'metrale-attn[vllm]' (it brings cupy-cuda13x, for vLLM 0.33's CUDA 13)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def _max_batch(vllm_config: Optional[VllmConfig]) -> int:
    """The most requests one decode call takes: vLLM's ``max_num_seqs``, or the requests of
    its largest CUDA-graph bucket (tokens / decode query length) when that is more."""
    if vllm_config is None:
        return 256
    capture = vllm_config.compilation_config.max_cudagraph_capture_size or 0
    return max(vllm_config.scheduler_config.max_num_seqs, -(-capture // _decode_q_len(vllm_config)))


def cudagraph_support(vllm_config: VllmConfig) -> AttentionCGSupport:
    """``UNIFORM_BATCH`` when the uniform batches vLLM captures (1 + the speculative tokens a
    request) are decode batches of ours, at our ``decode_q_len``, and no micro-batching (DBO)
    can cut a multi-token request in two; else ``UNIFORM_SINGLE_TOKEN_DECODE``. The GQA and
    MLA builders both answer with it: both split off uniform decodes of up to ``decode_q_len``."""
    spec = vllm_config.speculative_config
    uniform = 1 + ((spec.num_speculative_tokens or 0) if spec is not None else 0)
    ours = _decode_q_len(vllm_config)
    if ours == uniform and (ours == 1 or not vllm_config.parallel_config.use_ubatching):
        return AttentionCGSupport.UNIFORM_BATCH
    return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def _decode_q_len(vllm_config: Optional[VllmConfig]) -> int:
    if vllm_config is None:
        return 1
    spec = max_decode_query_len(vllm_config) - 1
    return options.decode_q_len(spec, batch_invariant=bool(envs.VLLM_BATCH_INVARIANT))


# -- the impl ------------------------------------------------------------------------------


class MetraleAttentionImpl(AttentionImpl):
    """One decoder attention layer: decode rows on our kernels, the rest on vLLM's."""

    can_return_lse_for_decode: bool = False
    supports_quant_query_input: bool = False  # our kernels take the bf16/fp16 query

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None, sliding_window: Optional[int] = None,
                 kv_cache_dtype: str = "auto", logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER, kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None) -> None:
        if alibi_slopes is not None:
            raise ValueError(f"{BACKEND_NAME} has no ALiBi: select another attention backend for this model")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"{BACKEND_NAME} serves decoder self-attention only, got attn_type={attn_type}")
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        vllm_config = get_current_vllm_config_or_none()
        model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None) or torch.get_default_dtype()
        if str(model_dtype) not in options.MODEL_DTYPES:
            raise ValueError(f"{BACKEND_NAME} takes torch.bfloat16 or torch.float16 activations, got {model_dtype}")
        self.num_heads, self.head_size, self.num_kv_heads, self.scale = num_heads, head_size, num_kv_heads, float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.q_dtype = options.MODEL_DTYPES[str(model_dtype)]
        self.kv_dtype = options.kv_dtype(kv_cache_dtype, self.q_dtype)
        self.window_left = options.window_left(sliding_window)
        self.logits_soft_cap = options.soft_cap(logits_soft_cap)
        self.sinks = sinks
        self.fp8 = options.is_fp8(kv_cache_dtype)
        model = model_attention(vllm_config)
        found = _capability()
        why = options.layer_refusal(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                    q_dtype=self.q_dtype, kv_dtype=self.kv_dtype, max_q_len=model.max_q_len,
                                    window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
                                    sinks=sinks is not None, fp8=self.fp8, capability=(found.major, found.minor))
        if why is not None:  # now, not when the KV cache exists and the builder binds the layer
            raise ValueError(f"{BACKEND_NAME} cannot serve this layer ({num_heads} q / {num_kv_heads} KV heads, head "
                             f"size {head_size}): {why}; select another attention backend for this model")
        self.prefill_backend = prefill_backend(head_size=head_size, dtype=model_dtype, kv_cache_dtype=kv_cache_dtype,
                                               has_sink=sinks is not None)
        self.prefill_impl = self.prefill_backend.get_impl_cls()(
            num_heads, head_size, scale, num_kv_heads, None, sliding_window, kv_cache_dtype, logits_soft_cap,
            attn_type, kv_sharing_target_layer_name, sinks=sinks)
        self.model = model
        self.model.reserve(num_heads, num_kv_heads, head_size)
        self.decoder = None  # this layer's DecodeAttention, built by the metadata builder (bind)
        self._handle: Optional[int] = None  # its handle, what the op takes
        self._sinks = None  # float32 [num_heads] sink logits, the kernels' view of `sinks`

    def get_impl_variants(self) -> tuple:
        """This impl and the prefill impl inside it, as vLLM's composite backend lists its
        children: vLLM scans layers for their FlashAttention impls (FA3's ahead-of-time
        scheduler reads every layer's sliding window that way)."""
        return self, self.prefill_impl

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """After the weights (and after an in-place reload): the prefill impl's own step, the
        model's workspace allocated (before vLLM profiles memory to size the KV cache),
        and the kernels' float32 sinks refreshed in place (a captured graph holds their
        address)."""
        self.prefill_impl.process_weights_after_loading(act_dtype)
        self.model.allocate()
        if self._sinks is not None:
            self._sinks.copy_(self.sinks.detach())

    def bind(self, page_size: int) -> None:
        """Build this layer's ``DecodeAttention`` for pages of ``page_size`` tokens (once:
        a KV cache group's builders all bind the same layers)."""
        if self.decoder is not None:
            if self.decoder.page_size != page_size:
                raise ValueError(f"{BACKEND_NAME}: a layer bound to pages of {self.decoder.page_size} tokens was "
                                 f"asked for {page_size}")
            return
        if self.sinks is not None:  # sink logits as the kernels read them: one float32 copy, once
            self._sinks = self.sinks.detach().to(torch.float32).contiguous()
        self.decoder = self.model.layer(
            self.num_heads, self.num_kv_heads, self.head_size, page_size, q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
            kv_layout="HND", sm_scale=self.scale, window_left=self.window_left, logits_soft_cap=self.logits_soft_cap,
            sinks=self.sinks is not None, device_scales=self.fp8)
        self._handle = self.decoder.handle
        logger.debug("%s: %d/%d heads, head size %d, pages of %d: %s; batch 1: %s", BACKEND_NAME, self.num_heads,
                     self.num_kv_heads, self.head_size, page_size, self.decoder.target_line(),
                     self.decoder.plan(1).reason)

    def do_kv_cache_update(self, layer, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """Write this step's K and V into the cache: vLLM's own kernel on a GPU (the prefill
        impl's ``reshape_and_cache_flash``), the same semantics in torch on the host."""
        if kv_cache.device.type != "cpu":
            self.prefill_impl.do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
            return
        write_kv_cache(key, value, kv_cache, slot_mapping, fp8=self.fp8, k_scale=layer._k_scale_float,
                       v_scale=layer._v_scale_float)

    def forward(self, layer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Optional[MetraleAttentionMetadata], output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``query``/``output`` ``[num_tokens, num_heads, head_size]``; decode rows first."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} has no fused output quantization")
        md = attn_metadata
        if md is None:  # vLLM's profiling run
            return output.fill_(0)
        if md.num_decodes:
            rows, q_len, D = md.num_decodes, md.decode_q_len, self.head_size
            q, out = query[:rows * q_len], output[:rows * q_len]
            if q_len > 1:
                q = q.view(rows, q_len, self.num_heads, D)
                out = out.view(rows, q_len, self.num_heads, D)
            # fp8: the layer's own fp32 scale tensors, read by the kernels (a captured graph follows a
            # reload that changes them; nothing syncs to read them)
            scales = dict(k_scales=layer._k_scale, v_scales=layer._v_scale) if self.fp8 else {}
            ModelAttention.decode(self._handle, q, kv_cache[..., :D], kv_cache[..., D:], md.block_table, md.seq_lens,
                                  out, sinks=self._sinks, **scales)
        if md.prefill is not None:
            start = md.prefill_start
            self.prefill_impl.forward(layer, query[start:], None if key is None else key[start:],
                                      None if value is None else value[start:], kv_cache, md.prefill, output[start:])
        return output


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                   fp8: bool, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """``reshape_and_cache_flash`` in torch: token ``i``'s K and V (``[num_tokens, kv_heads,
    head_size]``, rows past ``slot_mapping``'s length are padding) into slot
    ``slot_mapping[i]`` (block ``slot // block_size``, offset ``slot % block_size``) of the
    logical ``[blocks, kv_heads, block_size, 2 x head_size]`` cache; a negative slot is
    skipped. fp8: ``value / scale`` rounded to e4m3 with saturation, stored as bits."""
    n, head_size, block_size = slot_mapping.shape[0], key.shape[-1], kv_cache.shape[2]
    keep, blocks, offsets = cache_slots(slot_mapping, block_size)
    for half, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        stored = cache_values(x[:n][keep], kv_cache.dtype, fp8=fp8, scale=scale)
        kv_cache[blocks, :, offsets, half * head_size:(half + 1) * head_size] = stored


def cache_slots(slot_mapping: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(keep, blocks, offsets)`` of vLLM's slot mapping: which tokens have a slot (a negative
    slot is padding, skipped), and each kept token's block (``slot // block_size``) and offset
    in it (``slot % block_size``)."""
    slots = slot_mapping.to(torch.int64)
    keep = slots >= 0
    return keep, slots[keep] // block_size, slots[keep] % block_size


def cache_values(x: torch.Tensor, cache_dtype: torch.dtype, *, fp8: bool, scale: float = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` stores it: fp8, ``x / scale`` rounded to e4m3 with
    saturation (vLLM's cache kernels), as the cache's dtype (uint8 bits, or e4m3 itself); else ``x``
    in ``cache_dtype``."""
    if fp8:
        x = (x.float() / scale).clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn)
        return x if cache_dtype == torch.float8_e4m3fn else x.view(torch.uint8).to(cache_dtype)
    return x.to(cache_dtype)


_E4M3_MAX = 448.0
