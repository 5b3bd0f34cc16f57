"""The vLLM v1 MLA backend: ``MetraleMLABackend`` (``--attention-backend METRALE_ATTN_MLA``), for
DeepSeek-V2/V3/R1, Kimi-K2 and the models built on them.

vLLM's ``MLAAttention`` layer does the absorbed-form bookkeeping itself (``MLACommonImpl``): it
writes each token's latent ``kv_c`` (512) and rope key ``k_pe`` (64) into one cache row of 576,
runs the prefill tokens on its own MLA prefill backend (``forward_mha``, chosen by vLLM,
untouched here), multiplies the decode tokens' queries by W_UK into the latent space and
calls ``forward_mqa`` with them; what comes back (the latent output, 512 a head) it multiplies by
W_UV. So ``forward_mqa`` is exactly the library's MLA decode: ``DecodeAttention(num_heads, 1,
576, page_size, v_head_dim=512)`` on the ``simt`` kernels, over vLLM's latent cache ``[blocks,
block_size, 576]`` viewed as NHD ``[blocks, block_size, 1, 576]``, with V its first 512 dims (a view:
for bf16 the binder sees the alias and reads V from K's registers). Nothing is copied but the
query's two halves, which vLLM hands over apart and the kernels read as one row of 576.

What differs from the GQA backend (``backend.py``), and why:

* Speculative decoding and MTP: vLLM's ``UNIFORM`` query length support, as its FlashMLA and
  Triton MLA backends declare it. A decode is a request of ``decode_q_len`` (1 + the speculative
  tokens, at most 8) or fewer query tokens, every decode of a step the same length (vLLM's
  ``require_uniform`` split: a request whose drafts came up short, and all after it, go to the
  prefill backend), run as one multi-token call (``max_q_len``) on the ``simt`` kernels, token
  ``t`` of a request of ``L`` keys seeing keys ``0..L-q_len+t``. Under ``VLLM_BATCH_INVARIANT``, or
  past 7 speculative tokens, ``decode_q_len`` is 1 and verification requests are prefills
  (``options.decode_q_len``, as the GQA backend). CUDA graphs: uniform decode batches of
  ``decode_q_len`` tokens a request (``backend.cudagraph_support``).
* fp8 caches (``fp8``/``fp8_e4m3``, e4m3 bits with vLLM's per-tensor ``_k_scale``): the kernels
  read the layer's ``_k_scale`` tensor on the device (``device_scales``, as the GQA backend reads
  ``_k_scale``/``_v_scale``) for K and V alike: one latent row holds both, quantized with
  ``_k_scale`` by vLLM's ``concat_and_cache_mla``. A captured graph follows a reload that changes it.
* No lse (``can_return_lse_for_decode``): vLLM asks for it only under decode context
  parallelism, which the impl does not declare.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from vllm.config import VllmConfig, get_current_vllm_config, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.mla_attention import (
    MLAAttention,
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.platforms.interface import DeviceCapability
from vllm.v1.attention.backend import AttentionCGSupport, AttentionLayer, AttentionType

from ...logs import follow_vllm
from ...serving import ModelAttention
from . import MLA_BACKEND_NAME, options
from .backend import (
    KERNEL_BLOCK_SIZES,
    _capability,
    _splitk_policy,
    cache_slots,
    cache_values,
    cudagraph_support,
    decode_rows,
    model_attention,
)

logger = init_logger(__name__)
follow_vllm()

HEAD_SIZE, V_HEAD_DIM = options.MLA_HEAD_SIZE, options.MLA_V_HEAD_DIM


class MetraleMLABackend(MLACommonBackend):
    """MLA decode on metrale-attn (``simt``, 576/512), prefill on vLLM's MLA prefill backend."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = list(options.KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return MLA_BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["MetraleMLAImpl"]:
        return MetraleMLAImpl

    @staticmethod
    def get_builder_cls() -> type["MetraleMLAMetadataBuilder"]:
        return MetraleMLAMetadataBuilder

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [HEAD_SIZE]

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list:
        """Our page sizes, largest first; vLLM's MLA prefill reads the cache through the same block
        table at any size."""
        return list(KERNEL_BLOCK_SIZES)

    @classmethod
    def supports_compute_capability(cls, capability: DeviceCapability) -> bool:
        return options.capability_refusal((capability.major, capability.minor)) is None

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        """As the GQA backend: decode bytes do not depend on the batch under ``auto`` and pinned
        split-K policies."""
        return _splitk_policy().kind != "legacy"

    @classmethod
    def validate_configuration(cls, *args, **kwargs) -> list[str]:
        """vLLM's checks, each bare refusal replaced by ours naming the value and what works
        (``options.mla_selection_refusals``)."""
        import inspect

        reasons = super().validate_configuration(*args, **kwargs)
        given = inspect.signature(super().validate_configuration).bind(*args, **kwargs).arguments
        capability = given.get("device_capability")
        ours = options.mla_selection_refusals(
            head_size=given.get("head_size"), dtype=str(given.get("dtype")), kv_cache_dtype=given.get("kv_cache_dtype"),
            block_size=given.get("block_size"), attn_type=given.get("attn_type"),
            capability=None if capability is None else (capability.major, capability.minor))
        return options.with_what_works(reasons, ours)


@dataclass
class MetraleMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's MLA decode metadata and the decodes' one query length (``q_len`` tokens each)."""

    q_len: int = 1


class MetraleMLAMetadataBuilder(MLACommonMetadataBuilder[MLACommonMetadata]):
    """vLLM's MLA metadata (decode requests first, ``q_len`` tokens each, one ``q_len`` a step;
    the prefill part built for vLLM's MLA prefill backend), and each layer's ``DecodeAttention``
    built once the block size is known. CUDA graphs (``get_cudagraph_support``): uniform decode
    batches, which run our kernels only, on the persistent seq_lens and block table (padding
    requests: seq_len 0, zeros out)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH
    # One query length a call (our multi-token decode takes [seqs, q_len, H, D]): vLLM's split
    # then keeps the decodes uniform (require_uniform), the rest go to the prefill backend
    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec) -> AttentionCGSupport:
        """As the GQA backend's (``backend.cudagraph_support``): full graphs of uniform decode
        batches when those are ours at 1 + the speculative tokens, else of single-token ones."""
        return cudagraph_support(vllm_config)

    def __init__(self, kv_cache_spec, layer_names: list[str], vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        impls = _our_impls(vllm_config, layer_names)
        if not impls:
            raise ValueError(f"{MLA_BACKEND_NAME}: no MLA attention layer of ours among {layer_names}")
        # vLLM raised the threshold to 1 + the speculative tokens (UNIFORM); ours is lower where
        # verification is a prefill (batch-invariant mode, past 7 speculative tokens)
        self.reorder_batch_threshold = impls[0].model.max_q_len
        for impl in impls:
            impl.bind(kv_cache_spec.block_size)

    def _build_decode(self, block_table_tensor: torch.Tensor, seq_lens_device: torch.Tensor, max_seq_len: int,
                      query_start_loc_cpu: torch.Tensor, query_start_loc_device: torch.Tensor,
                      num_decode_tokens: int, max_query_len: int,
                      dcp_tot_seq_lens_device: Optional[torch.Tensor]) -> MetraleMLADecodeMetadata:
        """The decode requests (vLLM's padding requests of a graph bucket included while their
        tokens are in the bucket) and their one query length, the layout checked here, once a
        step (``backend.decode_rows``: equal lengths, padding last)."""
        requests, q_len = decode_rows(query_start_loc_cpu, query_start_loc_cpu.shape[0] - 1, num_decode_tokens)
        return MetraleMLADecodeMetadata(block_table=block_table_tensor[:requests],
                                        seq_lens=seq_lens_device[:requests],
                                        dcp_tot_seq_lens=dcp_tot_seq_lens_device, q_len=q_len)


def _our_impls(vllm_config: VllmConfig, layer_names) -> list["MetraleMLAImpl"]:
    layers = get_layers_from_vllm_config(vllm_config, MLAAttention, layer_names)
    return [layer.impl for layer in layers.values() if isinstance(layer.impl, MetraleMLAImpl)]


class MetraleMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """One MLA layer's decode (``forward_mqa``) on our kernels; prefill is ``MLACommonImpl``'s."""

    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: Optional[list[float]], sliding_window: Optional[int], kv_cache_dtype: str,
                 logits_soft_cap: Optional[float], attn_type: str, kv_sharing_target_layer_name: Optional[str],
                 **mla_args) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                         logits_soft_cap, attn_type, kv_sharing_target_layer_name, **mla_args)
        if alibi_slopes is not None or sliding_window is not None or logits_soft_cap:
            raise ValueError(f"{MLA_BACKEND_NAME} has no ALiBi, sliding window or logits soft-cap under MLA, got "
                             f"alibi_slopes={alibi_slopes!r}, sliding_window={sliding_window!r}, "
                             f"logits_soft_cap={logits_soft_cap!r}: select another MLA backend for this model")
        if attn_type != AttentionType.DECODER:
            raise ValueError(f"{MLA_BACKEND_NAME} serves decoder self-attention only, got attn_type={attn_type}")
        if (head_size, self.kv_lora_rank) != (HEAD_SIZE, V_HEAD_DIM):
            raise ValueError(f"{MLA_BACKEND_NAME} decodes MLA layers of kv_lora_rank {V_HEAD_DIM} and head size "
                             f"{HEAD_SIZE} (+ a qk_rope_head_dim of {HEAD_SIZE - V_HEAD_DIM}), got kv_lora_rank "
                             f"{self.kv_lora_rank} and head size {head_size}")
        vllm_config = get_current_vllm_config()
        model_dtype = vllm_config.model_config.dtype if vllm_config.model_config else torch.get_default_dtype()
        if str(model_dtype) not in options.MODEL_DTYPES:
            raise ValueError(f"{MLA_BACKEND_NAME} takes torch.bfloat16 or torch.float16 activations, got {model_dtype}")
        self.q_dtype = options.MODEL_DTYPES[str(model_dtype)]
        self.kv_dtype = options.kv_dtype(kv_cache_dtype, self.q_dtype)
        self.fp8 = options.is_fp8(kv_cache_dtype)
        # Our kernels read the bf16/fp16 query over an fp8 cache: vLLM must not quantize it.
        self.supports_quant_query_input = False
        found = _capability()
        why = options.layer_refusal(num_heads=num_heads, num_kv_heads=1, head_size=HEAD_SIZE, v_head_dim=V_HEAD_DIM,
                                    q_dtype=self.q_dtype, kv_dtype=self.kv_dtype,
                                    capability=(found.major, found.minor))
        if why is not None:  # now, not when the KV cache exists and the builder binds the layer
            raise ValueError(f"{MLA_BACKEND_NAME} cannot serve this MLA layer ({num_heads} q heads, "
                             f"{HEAD_SIZE}/{V_HEAD_DIM}): {why}; select another MLA backend for this model")
        self.model = model_attention(vllm_config)
        self.model.reserve(num_heads, 1, HEAD_SIZE, V_HEAD_DIM)
        self.decoder = None  # this layer's DecodeAttention, built by the metadata builder (bind)
        self._handle: Optional[int] = None

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """The model's split-K workspace, allocated before vLLM profiles memory for the KV cache."""
        super().process_weights_after_loading(act_dtype)
        self.model.allocate()

    def bind(self, page_size: int) -> None:
        """Build this layer's ``DecodeAttention`` for pages of ``page_size`` tokens (once)."""
        if self.decoder is not None:
            if self.decoder.page_size != page_size:
                raise ValueError(f"{MLA_BACKEND_NAME}: a layer bound to pages of {self.decoder.page_size} tokens "
                                 f"was asked for {page_size}")
            return
        self.decoder = self.model.layer(self.num_heads, 1, HEAD_SIZE, page_size, v_head_dim=V_HEAD_DIM,
                                        q_dtype=self.q_dtype, kv_dtype=self.kv_dtype, kv_layout="NHD",
                                        sm_scale=self.scale, device_scales=self.fp8)
        self._handle = self.decoder.handle
        logger.debug("%s: %d heads, %d/%d, pages of %d: %s; batch 1: %s", MLA_BACKEND_NAME, self.num_heads, HEAD_SIZE,
                     V_HEAD_DIM, page_size, self.decoder.target_line(), self.decoder.plan(1).reason)

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor,
                           skip_scale: bool = False) -> None:
        """This step's latent rows into the cache: vLLM's ``concat_and_cache_mla`` on a GPU, the
        same semantics in torch on the host (``write_mla_cache``)."""
        if kv_cache.device.type != "cpu":
            super().do_kv_cache_update(kv_c_normed, k_pe, kv_cache, slot_mapping, kv_cache_dtype, k_scale, skip_scale)
            return
        if kv_cache.numel():
            write_mla_cache(kv_c_normed, k_pe, kv_cache, slot_mapping, fp8=self.fp8,
                            scale=1.0 if skip_scale else float(k_scale))

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    layer: AttentionLayer) -> tuple[torch.Tensor, None]:
        """The decode rows' latent output ``[rows, num_heads, 512]`` (and no lse). ``q``: ``[rows,
        num_heads, 576]``, or vLLM's ``(ql_nope [rows, H, 512], q_pe [rows, H, 64])``, joined once;
        rows are the decode requests' ``q_len`` tokens each, request-major. The cache ``[blocks,
        block_size, 576]`` (fp8: e4m3 values, or their uint8 bits)."""
        if isinstance(q, tuple):
            q = torch.cat(q, dim=-1)
        decode = attn_metadata.decode
        rows = q.shape[0]
        requests, q_len = (0, 1) if decode is None else (decode.seq_lens.shape[0], decode.q_len)
        if decode is None or rows != requests * q_len:
            raise ValueError(f"{MLA_BACKEND_NAME} decodes {q_len} query token(s) a request: {rows} query rows for "
                             f"{None if decode is None else requests} decode requests")
        cache = kv_c_and_k_pe_cache.unsqueeze(2)  # NHD [blocks, block_size, 1 latent head, 576]
        lead = (requests, q_len) if q_len > 1 else (rows,)  # multi-token decode: [requests, q_len, H, D]
        out = q.new_empty(*lead, self.num_heads, V_HEAD_DIM)
        # One latent row holds K and V, quantized with the layer's one scale: its fp32 tensor, read by the
        # kernels (a captured graph follows a reload that changes it; nothing syncs to read it)
        scales = dict(k_scales=layer._k_scale, v_scales=layer._k_scale) if self.fp8 else {}
        ModelAttention.decode(self._handle, q.view(*lead, self.num_heads, HEAD_SIZE), cache, cache[..., :V_HEAD_DIM],
                              decode.block_table, decode.seq_lens, out, **scales)
        return out.view(rows, self.num_heads, V_HEAD_DIM), None


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *,
                    fp8: bool, scale: float = 1.0) -> None:
    """``concat_and_cache_mla`` in torch: token ``i``'s latent ``kv_c[i]`` (512) then ``k_pe[i]``
    (64; ``[tokens, 64]`` or ``[tokens, 1, 64]``) into row ``slot_mapping[i] % block_size`` of block
    ``slot_mapping[i] // block_size`` of the ``[blocks, block_size, 576]`` cache; a negative slot is
    skipped, rows past ``slot_mapping``'s length are padding. fp8: ``value / scale`` in e4m3."""
    n = slot_mapping.shape[0]
    keep, blocks, offsets = cache_slots(slot_mapping, kv_cache.shape[1])
    row = torch.cat([kv_c[:n], k_pe[:n].reshape(n, -1)], dim=-1)[keep]
    kv_cache[blocks, offsets] = cache_values(row, kv_cache.dtype, fp8=fp8, scale=scale)
