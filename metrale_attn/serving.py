"""One model's decode attention inside a serving process: what an engine holds.

``ModelAttention`` owns, for one model on one device, the ``DecodeAttention`` object of
every attention layer and the one split-K workspace they all share, a torch tensor
(so an engine's memory accounting sees it), sized for every layer shape the model
declares. A decode step calls ``ModelAttention.decode`` once per layer, which is the
custom op ``torch.ops.metrale_attn.paged_decode``: what ``torch.compile`` traces as one
node and a CUDA graph captures. ``examples/decode_loop.py`` and the vLLM backend
(``metrale_attn.integrations.vllm``) both run their decode tokens through this class,
so what the GPU check proves of the loop is what vLLM calls.

Invariant: the workspace is sized before the first layer is built and never moves
afterwards (a captured graph holds its address); a shape declared later that needs
more is refused.
"""

from __future__ import annotations

import threading
from typing import Optional

import torch

from . import torch_op  # registers torch.ops.metrale_attn.paged_decode
from .attention import DecodeAttention
from .plan import LEGACY_MAX_DECODE_SEQS
from .workspace import workspace_bytes


class ModelAttention:
    """The attention layers of one model on one device, over one split-K workspace.

    ``device``: a torch device (``"cuda:0"``, ``"cpu"``); the backend follows it (CuPy on
    CUDA, the CPU backend on the host) unless ``backend`` names one. ``max_batch``:
    the most sequences one decode call carries (an engine's largest batch or CUDA-graph
    bucket); ``max_q_len``: the most query tokens per sequence (1 + speculative tokens,
    at most 8). ``splitk`` and ``target`` are ``DecodeAttention``'s and apply to every
    layer, so every layer sizes its partials alike.

    Use: ``reserve`` every layer shape (or let ``layer`` reserve its own, when all layers
    are built together), optionally ``allocate`` early (an engine that profiles memory
    before it sizes its KV cache), then ``layer`` once per attention layer, then
    ``decode`` every step. Thread-safe.
    """

    def __init__(self, device, *, max_batch: int, max_q_len: int = 1, backend=None, splitk: Optional[str] = None,
                 target: Optional[str] = None, max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS) -> None:
        self.device = torch.device(device)
        if backend is None:
            backend = "cupy" if self.device.type == "cuda" else "cpu"
        self.backend, self.max_batch, self.max_q_len = backend, max_batch, max_q_len
        self._sizing = dict(max_batch=max_batch, max_q_len=max_q_len, backend=backend, splitk=splitk, target=target,
                            max_decode_seqs=max_decode_seqs)
        self._options = dict(max_batch=max_batch, backend=backend, splitk=splitk, target=target,
                             max_decode_seqs=max_decode_seqs)
        self._lock = threading.Lock()
        self._nbytes = 0  # bytes the reserved shapes need
        self._workspace: Optional[torch.Tensor] = None
        self.layers: list[DecodeAttention] = []

    def reserve(self, num_q_heads: int, num_kv_heads: int, head_dim: int, v_head_dim: Optional[int] = None) -> int:
        """Make the workspace large enough for a layer of this shape (``v_head_dim``: the values'
        width, default ``head_dim``); returns its bytes. Refused once a layer exists and the
        shape needs more than was reserved (the workspace may not move under built layers)."""
        need = workspace_bytes([(num_q_heads, num_kv_heads, head_dim, v_head_dim)], **self._sizing)
        with self._lock:
            if need > self._nbytes:
                if self.layers:
                    raise ValueError(
                        f"a layer of {num_q_heads} q heads, {num_kv_heads} kv heads and head dim {head_dim} needs a "
                        f"split-K workspace of {need} bytes, but this model's is {self._nbytes} bytes and its layers "
                        "are built on it: reserve every layer shape before building the first layer")
                self._nbytes = need
                self._workspace = None  # not handed out yet: allocate the larger one when asked
        return need

    @property
    def workspace_nbytes(self) -> int:
        """Bytes of the workspace: the most any reserved shape needs."""
        return self._nbytes

    def allocate(self) -> torch.Tensor:
        """The workspace, allocated now if it is not yet (``torch.empty`` of uint8 on
        ``device``); the same tensor from then on."""
        with self._lock:
            return self._allocate_locked()

    def _allocate_locked(self) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(max(self._nbytes, 16), dtype=torch.uint8, device=self.device)
        return self._workspace

    def layer(self, num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int, *, q_dtype, kv_dtype,
              kv_layout: str = "NHD", **features) -> DecodeAttention:
        """A new ``DecodeAttention`` for one layer, on this model's workspace (its shape is
        reserved first). ``features``: ``DecodeAttention``'s keyword arguments
        (``window_left``, ``logits_soft_cap``, ``sinks``, ``sm_scale``, ...); ``max_q_len``
        is this model's."""
        self.reserve(num_q_heads, num_kv_heads, head_dim, features.get("v_head_dim"))
        with self._lock:
            workspace = self._allocate_locked()
            attn = DecodeAttention(num_q_heads, num_kv_heads, head_dim, page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
                                   kv_layout=kv_layout, max_q_len=self.max_q_len, workspace=workspace, **self._options,
                                   **features)
            self.layers.append(attn)
        return attn

    @staticmethod
    def decode(attn, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, out: torch.Tensor, *, k_scale: float = 1.0, v_scale: float = 1.0,
               sinks: Optional[torch.Tensor] = None, k_scales: Optional[torch.Tensor] = None,
               v_scales: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One layer's decode step into ``out``, through ``torch.ops.metrale_attn.paged_decode``
        (``attn``: the layer's object or its ``handle``; pass the int under
        ``torch.compile``). Shapes and semantics are ``DecodeAttention.run``'s."""
        return torch_op.decode(attn, q, k_cache, v_cache, block_tables, seq_lens, out, k_scale=k_scale,
                               v_scale=v_scale, sinks=sinks, k_scales=k_scales, v_scales=v_scales)
