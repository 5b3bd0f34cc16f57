"""The SGLang attention backend: ``MetraleSGLangBackend``, decode on our kernels over
SGLang's token pool, every other forward mode on SGLang's own backend.

What routes where is in the package's first lines (``metrale_attn.integrations.sglang``).
The pieces, in the order SGLang meets them:

* ``__init__`` (SGLang's factory, once per model runner): the model-wide refusals
  (``options.model_refusals``: dtypes, page size, the pool (the hybrid SWA pool, MLA pools
  other than the plain latent one), decode context parallelism, the device),
  so a model that is not ours stops at start-up with the reasons; one ``ModelAttention``
  (the shared split-K workspace) sized for SGLang's largest batch.
* ``init_forward_metadata`` / ``init_forward_metadata_out_graph``: for a decode batch the
  CSR page table (``csr.fill_csr``) of its ``req_to_token`` rows, into fresh tensors in
  eager mode and into the fixed-address buffers of ``init_cuda_graph_state`` under CUDA
  graphs (capture and replay fill the same buffers, outside the graph: the fill reads
  host lengths); any other mode goes to the prefill backend's own methods. Under
  speculative decoding the prefill backend also gets CUDA-graph state (verification batches
  are captured on it), and answers the verification mask and its updates; DeepSeek's
  chunked-prefix prefill planning (``init_mha_chunk_metadata``) is its too.
* ``forward_decode``: this step's K and V into the pool (SGLang's ``set_kv_buffer``), then
  ``torch.ops.metrale_attn.paged_decode`` on views of SGLang's tensors (q, the layer's
  K and V buffers as page-size-1 NHD caches): no copy. An MLA layer's V buffer is a view of
  its K buffer's first 512 dims (``MLATokenToKVPool``), which the kernels read from K's rows.
  A layer's ``DecodeAttention`` is built at its first decode (SGLang's warm-up runs before
  any capture) and kept, keyed on everything it binds (heads, head dims, scale, window,
  soft-cap, dtypes): a layer that comes back different is refused rather than run on the
  old object.
* ``forward_extend``: the prefill backend's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Optional

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from ... import torch_op
from ...serving import ModelAttention
from . import BACKEND_NAME, csr, options


@dataclasses.dataclass
class DecodeMetadata:
    """One decode batch's page table, as our kernels read it (views of SGLang-sized buffers)."""

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor


def _capability(device: torch.device) -> Optional[tuple[int, int]]:
    return tuple(torch.cuda.get_device_capability(device)) if device.type == "cuda" else None


def _speculating() -> bool:
    """Whether SGLang runs speculative decoding (EAGLE, MTP, n-gram), from its published config;
    where nothing was published (classes built by hand, as in the tests) SGLang raises: not."""
    from sglang.srt.runtime_context import get_spec

    try:
        return get_spec().speculative_algorithm is not None
    except ValueError:  # "config namespace 'spec' not published"
        return False


def _dcp_enabled() -> bool:
    """Whether SGLang runs decode context parallelism (``--dcp-size`` > 1), from its parallel
    context, which a launch publishes before any backend is built. Where nothing was published
    (a process that builds SGLang's classes by hand, as the tests do) SGLang raises; no DCP there."""
    from sglang.srt.runtime_context import get_parallel

    try:
        return bool(get_parallel().dcp_enabled)
    except RuntimeError:  # "derived parallel width 'dcp_enabled' is not available": nothing published
        return False


class MetraleSGLangBackend(AttentionBackend):
    """Decode on metrale-attn; extend, mixed, verification and idle batches on SGLang's
    ``METRALE_ATTN_SGLANG_PREFILL`` backend (``triton`` by default)."""

    def __init__(self, runner):
        super().__init__()
        self.runner = runner
        self.device = torch.device(runner.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.req_to_token = runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = runner.token_to_kv_pool
        dtype = getattr(runner, "dtype", None) or runner.model_config.dtype
        reasons = options.model_refusals(
            dtype=str(dtype), kv_cache_dtype=str(getattr(runner, "kv_cache_dtype", dtype)),
            page_size=int(runner.page_size), use_mla=bool(getattr(runner, "use_mla_backend", False)),
            kv_pool=type(self.token_to_kv_pool).__name__, dcp=_dcp_enabled(), capability=_capability(self.device))
        if reasons:
            raise ValueError(f"--attention-backend {BACKEND_NAME} refuses this model: {'; '.join(reasons)}")
        if self.device.type == "cuda" and importlib.util.find_spec("cupy") is None:
            raise ValueError(f"{BACKEND_NAME} launches its kernels through CuPy, which is not installed: "
                             "pip install 'metrale-attn[sglang]'")
        self.q_dtype = options.MODEL_DTYPES[str(dtype)]
        self.prefill_name = os.environ.get(options.PREFILL_ENV, options.DEFAULT_PREFILL)
        if self.prefill_name == BACKEND_NAME or self.prefill_name not in ATTENTION_BACKENDS:
            raise ValueError(f"{options.PREFILL_ENV} must name another registered SGLang attention backend, got "
                             f"{self.prefill_name!r} (registered: {', '.join(sorted(ATTENTION_BACKENDS))})")
        self._prefill = None  # built at first use: under SGLang's hybrid split it is never needed
        server_args = getattr(runner, "server_args", None)
        graph_bs = getattr(server_args, "cuda_graph_max_bs", None) or 0
        self.max_bs = max(runner.req_to_token_pool.size, graph_bs)
        self.model = ModelAttention(self.device, max_batch=self.max_bs)
        self._layers: dict[int, tuple[tuple, int]] = {}  # layer_id -> (what it binds, handle)
        self._graph_buffers: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        self.forward_metadata = None

    # -- the prefill backend ---------------------------------------------------------------

    @property
    def prefill(self) -> AttentionBackend:
        """SGLang's backend for every batch that is not a decode batch, over the same pools."""
        if self._prefill is None:
            self._prefill = ATTENTION_BACKENDS[self.prefill_name](self.runner)
        return self._prefill

    # -- metadata --------------------------------------------------------------------------

    def init_forward_metadata(self, forward_batch):
        if not forward_batch.forward_mode.is_decode():
            self.prefill.init_forward_metadata(forward_batch)
            return
        bs, n = forward_batch.batch_size, int(forward_batch.seq_lens_sum)
        buffers = csr.allocate_csr(bs, n, self.device)
        self.forward_metadata = self._fill(forward_batch, buffers)

    def _fill(self, fb, buffers) -> DecodeMetadata:
        bs = fb.batch_size
        seq_lens_cpu = getattr(fb, "seq_lens_cpu", None)
        num_tokens = int(seq_lens_cpu[:bs].sum()) if seq_lens_cpu is not None else int(fb.seq_lens[:bs].sum())
        return DecodeMetadata(*csr.fill_csr(self.req_to_token, fb.req_pool_indices[:bs], fb.seq_lens[:bs],
                                            num_tokens, *buffers, seq_lens_cpu=seq_lens_cpu))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """Fixed-address CSR buffers for every captured batch size: ``kv_indices`` holds
        ``max_bs`` full contexts, as SGLang's Triton backend sizes its own."""
        if max_bs > self.max_bs:
            raise ValueError(f"{BACKEND_NAME}: CUDA-graph batch size {max_bs} exceeds the {self.max_bs} requests "
                             "the workspace was sized for")
        self._graph_buffers = csr.allocate_csr(max_bs, csr.csr_capacity(max_bs, self.req_to_token.shape[1]),
                                               self.device)
        if _speculating():  # verification batches are captured too, on the backend that verifies (as SGLang's
            self.prefill.init_cuda_graph_state(max_bs, max_num_tokens)  # own split backend does)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Capture and replay alike: the batch's page table into the graph buffers (the
        views keep their addresses, so the captured kernels read the replayed batch)."""
        if not forward_batch.forward_mode.is_decode():
            self.prefill.init_forward_metadata_out_graph(forward_batch, in_capture)
            return
        if self._graph_buffers is None:
            raise RuntimeError(f"{BACKEND_NAME}: init_cuda_graph_state was not called before CUDA-graph metadata")
        self.forward_metadata = self._fill(forward_batch, self._graph_buffers)

    def init_forward_metadata_in_graph(self, forward_batch):
        if not forward_batch.forward_mode.is_decode():
            self.prefill.init_forward_metadata_in_graph(forward_batch)

    def get_cuda_graph_seq_len_fill_value(self):
        """Padding requests of a captured batch have one token (slot 0 of pool row 0, the
        pool's padding entries), so they attend to something and write only padding rows."""
        return 1

    # -- what speculative decoding and MLA's chunked prefill ask of the model's backend ----------

    @property
    def verify_mask(self):
        """The tree mask the draft stage fills: the prefill backend's, which runs verification."""
        return self.prefill.verify_mask

    def update_verify_buffers_to_fill_after_draft(self, spec_info, cuda_graph_bs):
        self.prefill.update_verify_buffers_to_fill_after_draft(spec_info, cuda_graph_bs)

    def init_mha_chunk_metadata(self, forward_batch, *args, **kwargs):
        """DeepSeek's chunked-prefix prefill asks the model's backend to plan it: the prefill
        backend plans, where it has such a step (FlashInfer's MLA backend; Triton has none)."""
        plan = getattr(self.prefill, "init_mha_chunk_metadata", None)
        if plan is not None:
            plan(forward_batch, *args, **kwargs)

    # -- forward ---------------------------------------------------------------------------

    def _handle(self, layer) -> int:
        """The layer's ``DecodeAttention`` handle, built once and keyed on what it binds."""
        key = (layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim, float(layer.scaling),
               layer.sliding_window_size, float(layer.logit_cap or 0.0), layer.logit_capping_method,
               bool(layer.is_cross_attention), str(getattr(layer.attn_type, "value", layer.attn_type)))
        found = self._layers.get(layer.layer_id)
        if found is not None:
            if found[0] != key:
                raise ValueError(f"{BACKEND_NAME}: layer {layer.layer_id} was built as {found[0]} and came back as "
                                 f"{key}")
            return found[1]
        reasons = options.layer_refusals(head_dim=layer.qk_head_dim, v_head_dim=layer.v_head_dim,
                                         num_q_heads=layer.tp_q_head_num, num_kv_heads=layer.tp_k_head_num,
                                         is_cross_attention=layer.is_cross_attention, attn_type=key[-1],
                                         logit_capping_method=layer.logit_capping_method, logit_cap=layer.logit_cap,
                                         sliding_window_size=layer.sliding_window_size)
        if reasons:
            raise ValueError(f"{BACKEND_NAME} refuses layer {layer.layer_id}: {'; '.join(reasons)}")
        narrow = layer.v_head_dim if layer.v_head_dim != layer.qk_head_dim else None  # MLA's 512 of 576
        attn = self.model.layer(layer.tp_q_head_num, layer.tp_k_head_num, layer.qk_head_dim, 1, q_dtype=self.q_dtype,
                                kv_dtype=self.q_dtype, kv_layout="NHD", v_head_dim=narrow, sm_scale=float(layer.scaling),
                                window_left=options.window_left(layer.sliding_window_size),
                                logits_soft_cap=options.soft_cap(layer.logit_cap), page_table="csr")
        self._layers[layer.layer_id] = (key, attn.handle)
        return attn.handle

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """``q`` ``[bs, q_heads x head_dim]`` (or 3-D); returns ``[bs, q_heads x v_head_dim]``."""
        if kwargs:
            raise NotImplementedError(f"{BACKEND_NAME} decode takes no {', '.join(sorted(kwargs))}")
        handle = self._handle(layer)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc.for_batch(forward_batch), k, v)
        md = self.forward_metadata
        if not isinstance(md, DecodeMetadata):
            raise RuntimeError(f"{BACKEND_NAME}: forward_decode without decode metadata (init_forward_metadata)")
        H, D, Dv = layer.tp_q_head_num, layer.qk_head_dim, layer.v_head_dim
        q3 = q.reshape(-1, H, D)
        out = q3.new_empty((q3.shape[0], H, Dv))
        # Slots as pages of one token, NHD: [slots, kv_heads, dim] -> [slots, 1, kv_heads, dim]. MLA's
        # value buffer stays the view of the key buffer's first 512 dims that SGLang returns.
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).unsqueeze(1)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id).unsqueeze(1)
        torch_op.decode(handle, q3, k_cache, v_cache, None, None, out, kv_indptr=md.kv_indptr,
                        kv_indices=md.kv_indices, kv_last_page_len=md.kv_last_page_len)
        return out.view(-1, H * Dv)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        return self.prefill.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def support_triton(self):
        return self.prefill.support_triton()
