"""Drive the vLLM backend through vLLM's own machinery on the CPU, and judge what it writes.

vLLM's pieces, used as vLLM uses them: its plugin loader (which registers METRALE_ATTN),
``AttentionBackendEnum`` (which resolves it by name), a ``VllmConfig`` of a small model,
vLLM's ``Attention`` layers on our backend, a KV cache allocated as vLLM allocates it
(``compute_layout_strides`` over a flat byte buffer, one ``KVCacheLayout``),
``CommonAttentionMetadata`` with the fields vLLM's own test utilities fill, our builder,
and ``set_forward_context``, under which ``Attention.forward`` writes the step's K and V
(``do_kv_cache_update``) and attends (``forward``).

vLLM's prefill kernels need a GPU, so the prefill backend's ``forward`` is replaced by
``cpu_prefill_forward``: the same function in torch on the CPU, reading the metadata
vLLM's own prefill builder built. Every decode token is judged against the float64
reference at our 1-ulp bar, every prefill token at ``PREFILL_TOLERANCE``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, SpeculativeConfig, VllmConfig
from vllm.config import set_current_vllm_config
from vllm.forward_context import set_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.plugins import load_general_plugins
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, compute_layer_kv_cache_shape_bytes, compute_layout_strides
from vllm.v1.kv_cache_layout import KVCacheLayout

from metrale_attn import reference, tolerance
from metrale_attn.torch_op import to_numpy

load_general_plugins()
BACKEND = AttentionBackendEnum["METRALE_ATTN"].get_class()

NULL_BLOCK = 0
"""vLLM's null block: padding rows' block tables point at it, and no request owns it."""

PREFILL_TOLERANCE = dict(atol=1.5e-2, rtol=1e-2)
"""What vLLM's own attention-backend tests allow a bf16/fp16 prefill output (FlashAttention,
Triton) against a float reference."""

_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def model_dir(root: Path, *, num_heads: int, num_kv_heads: int, head_size: int) -> str:
    """A directory with the ``config.json`` of a small Llama (no weights: ``ModelConfig``
    reads the config only)."""
    path = Path(root) / f"llama-{num_heads}-{num_kv_heads}-{head_size}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": num_heads * head_size,
        "intermediate_size": 512, "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads,
        "head_dim": head_size, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}))
    return str(path)


def config(root: Path, *, num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64, dtype: str = "bfloat16",
           block_size: int = 16, max_num_seqs: int = 8, num_speculative_tokens: Optional[int] = None,
           kv_cache_dtype: str = "auto") -> VllmConfig:
    """A ``VllmConfig`` on the CPU device for a small model of this attention shape."""
    model = ModelConfig(model=model_dir(root, num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size),
                        skip_tokenizer_init=True, dtype=dtype, max_model_len=4096)
    return cpu_config(model, block_size=block_size, max_num_seqs=max_num_seqs,
                      num_speculative_tokens=num_speculative_tokens, kv_cache_dtype=kv_cache_dtype)


def cpu_config(model: ModelConfig, *, block_size: int = 16, max_num_seqs: int = 8,
               num_speculative_tokens: Optional[int] = None, kv_cache_dtype: str = "auto",
               **configs) -> VllmConfig:
    """A ``VllmConfig`` of ``model`` on the CPU device (``configs``: more of its parts, e.g.
    ``attention_config``); speculative decoding by n-gram drafts when asked."""
    spec = None
    if num_speculative_tokens:
        spec = SpeculativeConfig(method="ngram", num_speculative_tokens=num_speculative_tokens, prompt_lookup_max=3,
                                 prompt_lookup_min=1)
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size, cache_dtype=kv_cache_dtype),
                      device_config=DeviceConfig(device="cpu"), speculative_config=spec,
                      scheduler_config=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                                       max_model_len=4096, is_encoder_decoder=False), **configs)


def layers(vc: VllmConfig, count: int = 1, *, num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64,
           sliding_window: Optional[int] = None, logits_soft_cap: Optional[float] = None,
           sinks: Optional[torch.Tensor] = None, prefix: str = "model.layers",
           scale: Optional[float] = None) -> list[Attention]:
    """``count`` vLLM ``Attention`` layers on our backend, built as a model builds them (under
    the config, in the model dtype), their weights "loaded" (``process_weights_after_loading``).
    ``scale``: the softmax scale (default ``head_size ** -0.5``; Gemma 4 passes 1.0)."""
    extra = {} if sinks is None else {"sinks": sinks}
    scale = head_size ** -0.5 if scale is None else scale
    with set_current_vllm_config(vc), set_default_torch_dtype(vc.model_config.dtype):
        built = [Attention(num_heads, head_size, scale, num_kv_heads, cache_config=vc.cache_config,
                           logits_soft_cap=logits_soft_cap, per_layer_sliding_window=sliding_window,
                           prefix=f"{prefix}.{i}.attn", attn_backend=BACKEND, **extra) for i in range(count)]
        for layer in built:
            layer.process_weights_after_loading(vc.model_config.dtype)
    return built


def spec_of(layer: Attention, block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size, num_kv_heads=layer.num_kv_heads, head_size=layer.head_size,
                             dtype=layer.kv_cache_torch_dtype)


def builder(vc: VllmConfig, built: list[Attention], block_size: int):
    """Our metadata builder for these layers (one KV cache group), as vLLM builds it."""
    return BACKEND.get_builder_cls()(spec_of(built[0], block_size), [layer.layer_name for layer in built], vc,
                                     torch.device("cpu"))


def allocate_kv_cache(layer: Attention, num_blocks: int, block_size: int, layout: KVCacheLayout,
                      rng: np.random.Generator) -> torch.Tensor:
    """The layer's cache as vLLM allocates it: a flat byte buffer viewed through
    ``compute_layout_strides`` as logical ``[blocks, kv_heads, block_size, 2 x head_size]``,
    in ``layout``'s physical order; filled with random values (fp8: finite bit patterns)
    and bound to the layer."""
    spec = spec_of(layer, block_size)
    shape = compute_layer_kv_cache_shape_bytes(spec, num_blocks)
    strides = compute_layout_strides(spec, num_blocks, 1, layout)
    raw = torch.zeros(math.prod(shape), dtype=torch.int8)
    cache = torch.as_strided(raw, (1, *shape), strides)[0].view(spec.dtype)
    if spec.dtype == torch.uint8:
        bits = rng.integers(0, 0x7f, cache.shape, dtype=np.uint8) | (rng.integers(0, 2, cache.shape, dtype=np.uint8) << 7)
        cache.copy_(torch.from_numpy(bits))
    else:
        cache.copy_(torch.from_numpy(rng.standard_normal(cache.shape, dtype=np.float32)).to(spec.dtype))
    layer.kv_cache = cache
    return cache


@dataclasses.dataclass
class Batch:
    """One step's batch, as vLLM's model runner lays it out: ``cm`` (its
    ``CommonAttentionMetadata``), the step's fused ``qkv`` activations (q, k and v are
    strided views of it), and what the reference needs."""

    cm: CommonAttentionMetadata
    seq_lens: list[int]
    query_lens: list[int]
    block_table: torch.Tensor  # the persistent [max_num_seqs, width] table; cm holds a view of its rows
    qkv: torch.Tensor
    num_heads: int
    num_kv_heads: int
    head_size: int

    def split(self):
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_size
        return self.qkv[:, :H * D], self.qkv[:, H * D:(H + KV) * D], self.qkv[:, (H + KV) * D:]

    @property
    def starts(self) -> list[int]:
        return [0, *np.cumsum(self.query_lens).tolist()]


def batch(requests: list[tuple[int, int]], *, num_heads: int = 4, num_kv_heads: int = 2, head_size: int = 64,
          block_size: int = 16, num_blocks: int = 128, max_num_seqs: int = 8, rng: np.random.Generator,
          pad_to: Optional[int] = None, dtype=torch.bfloat16, prefilling: Optional[list[bool]] = None) -> Batch:
    """A batch of ``(seq_len, query_len)`` requests (seq_len counts this step's tokens),
    each on its own shuffled blocks (block 0, the null block, is nobody's). ``pad_to``:
    padded to that many requests as vLLM pads a uniform batch for its CUDA graph
    (padding requests: query length 0, seq_len 0, block-table rows of the null block,
    their tokens' slots -1)."""
    real = len(requests)
    seq_lens = [s for s, _ in requests]
    query_lens = [q for _, q in requests]
    num_reqs = pad_to or real
    q_len_pad = max(query_lens) if pad_to else 0
    width = max(-(-s // block_size) for s in seq_lens) + 1
    table = torch.full((max_num_seqs, width), NULL_BLOCK, dtype=torch.int32)
    free = (rng.permutation(num_blocks - 1) + 1).tolist()
    for r, s in enumerate(seq_lens):
        n = -(-s // block_size)
        table[r, :n] = torch.tensor(free[:n], dtype=torch.int32)
        free = free[n:]
    positions = [p for s, q in requests for p in range(s - q, s)]
    owners = [r for r, (_, q) in enumerate(requests) for _ in range(q)]
    slots = [int(table[r, p // block_size]) * block_size + p % block_size for r, p in zip(owners, positions)]
    tokens = len(positions) + (num_reqs - real) * q_len_pad
    slots += [-1] * (tokens - len(slots))
    positions += [0] * (tokens - len(positions))
    lens = seq_lens + [0] * (num_reqs - real)
    starts = [0, *np.cumsum(query_lens).tolist()] + [sum(query_lens)] * (num_reqs - real)
    qsl = torch.tensor(starts, dtype=torch.int32)
    prefilling = prefilling or [q > 1 and s == q for s, q in requests]
    cm = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(lens, dtype=torch.int32),
        num_reqs=num_reqs, num_actual_tokens=tokens, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=table[:num_reqs], slot_mapping=torch.tensor(slots, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(lens, dtype=torch.int32),
        is_prefilling=torch.tensor(prefilling + [False] * (num_reqs - real)),
        positions=torch.tensor(positions, dtype=torch.int64))
    H, KV, D = num_heads, num_kv_heads, head_size
    qkv = torch.from_numpy(rng.standard_normal((tokens, (H + 2 * KV) * D), dtype=np.float32)).to(dtype)
    return Batch(cm, seq_lens, query_lens, table, qkv, H, KV, D)


def forward(vc: VllmConfig, built: list[Attention], md, b: Batch) -> list[torch.Tensor]:
    """Every layer's ``Attention.forward`` on the batch under vLLM's forward context (which
    writes the step's K and V into each layer's cache, then attends); outputs
    ``[tokens, num_heads, head_size]``."""
    names = [layer.layer_name for layer in built]
    q, k, v = b.split()
    with set_forward_context({n: md for n in names}, vc, slot_mapping={n: b.cm.slot_mapping for n in names}):
        return [layer(q, k, v).view(-1, b.num_heads, b.head_size) for layer in built]


def reference_rows(layer: Attention, b: Batch, request: int) -> np.ndarray:
    """float64 ``[query_len, num_heads, head_size]``: request ``request``'s query tokens over
    the layer's cache as it is now (this step's K and V written), causal, with the
    layer's window, soft-cap, sinks and scales."""
    impl, D = layer.impl, b.head_size
    cache = to_numpy(layer.kv_cache)
    k_cache, v_cache = cache[..., :D], cache[..., D:]  # HND views, vLLM's strides
    start, stop = b.starts[request], b.starts[request + 1]
    q = to_numpy(b.split()[0][start:stop].reshape(stop - start, b.num_heads, D))
    scales = dict(k_scale=layer._k_scale_float, v_scale=layer._v_scale_float) if impl.fp8 else {}
    sinks = None if impl.sinks is None else impl.sinks.detach().float().numpy()
    return reference.paged_decode(
        q[None], k_cache, v_cache, b.cm.block_table_tensor[request:request + 1].numpy(),
        np.array([b.seq_lens[request]], np.int32), kv_layout="HND", sm_scale=impl.scale, window_left=impl.window_left,
        logits_soft_cap=impl.logits_soft_cap, sinks=sinks, **scales)[0]


def check_decode(layer: Attention, b: Batch, out: torch.Tensor, request: int, what: str) -> None:
    """A decode request's tokens within our 1-ulp bar of the float64 reference."""
    start, stop = b.starts[request], b.starts[request + 1]
    ref = reference_rows(layer, b, request)
    cache = to_numpy(layer.kv_cache)
    v_absmax = reference.max_abs_v_read(cache[..., b.head_size:], b.cm.block_table_tensor[request:request + 1].numpy(),
                                        np.array([b.seq_lens[request]], np.int32), kv_layout="HND",
                                        v_scale=layer._v_scale_float if layer.impl.fp8 else 1.0)
    tolerance.assert_close_to_reference(to_numpy(out[start:stop]), ref, v_absmax=v_absmax, what=what)


def check_prefill(layer: Attention, b: Batch, out: torch.Tensor, request: int, what: str) -> None:
    """A prefill request's tokens within ``PREFILL_TOLERANCE`` of the float64 reference."""
    start, stop = b.starts[request], b.starts[request + 1]
    ref = torch.from_numpy(reference_rows(layer, b, request))
    got = out[start:stop].double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    torch.testing.assert_close(got, ref, **PREFILL_TOLERANCE, msg=lambda m: f"{what}: {m}")


PREFILL_CALLS: list = []
"""What ``cpu_prefill_forward`` was called with: ``(layer name, query rows, the prefill
metadata's query_start_loc, seq_lens)`` per call."""


def cpu_prefill_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                        output_block_scale=None):
    """``TritonAttentionImpl.forward`` in torch on the CPU (vLLM's kernel needs a GPU): causal
    attention of each request's query tokens over its pages, with the impl's window,
    soft-cap, sinks and the layer's fp8 scales, in float32, into ``output``. It reads
    only what the Triton metadata builder built for the prefill requests."""
    md = attn_metadata
    PREFILL_CALLS.append((layer.layer_name, query.shape[0], md.query_start_loc.tolist(), md.seq_lens.tolist()))
    D, H, KV = self.head_size, self.num_heads, self.num_kv_heads
    cache = kv_cache
    if self.kv_cache_dtype.startswith("fp8"):
        cache = cache.view(torch.float8_e4m3fn)
    k_all, v_all = cache[..., :D].float(), cache[..., D:].float()
    if self.kv_cache_dtype.startswith("fp8"):
        k_all, v_all = k_all * layer._k_scale_float, v_all * layer._v_scale_float
    starts, lens, block_size = md.query_start_loc.tolist(), md.seq_lens.tolist(), kv_cache.shape[2]
    window = self.sliding_window[0]
    for r, seq_len in enumerate(lens):
        lo, hi = starts[r], starts[r + 1]
        pages = md.block_table[r, :-(-seq_len // block_size)].long()
        k = k_all[pages].transpose(1, 2).reshape(-1, KV, D)[:seq_len].repeat_interleave(H // KV, dim=1)
        v = v_all[pages].transpose(1, 2).reshape(-1, KV, D)[:seq_len].repeat_interleave(H // KV, dim=1)
        q = query[lo:hi].float()
        s = torch.einsum("qhd,khd->hqk", q, k) * self.scale
        if self.logits_soft_cap:
            s = self.logits_soft_cap * torch.tanh(s / self.logits_soft_cap)
        pos = torch.arange(seq_len - (hi - lo), seq_len)[:, None]
        key_pos = torch.arange(seq_len)[None, :]
        masked = key_pos > pos
        if window >= 0:
            masked |= key_pos < pos - window
        s = s.masked_fill(masked[None], float("-inf"))
        if self.sinks is not None:
            s = torch.cat([s, self.sinks.detach().float()[:, None, None].expand(H, hi - lo, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :seq_len]
        output[lo:hi] = torch.einsum("hqk,khd->qhd", p, v).to(output.dtype)
    return output
