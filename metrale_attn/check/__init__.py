"""``metrale-attn check``: the package proves itself on the user's own GPU, for their model, before serving.

It builds every kernel the model's layers need on this device, checks each arm's output (and
lse) against the float64 reference at the package's 1-ulp bar, then times batch 1, 16 and 64
at 4k and batch 1 at 32k (CUDA-graph replay, L2 flushed) against the copy bandwidth measured
in the same process, with PyTorch SDPA over gathered KV and FlashInfer beside ours where they
are installed. It writes ``report.md``, ``report.json`` and ``report.png`` (% of copy bandwidth
by batch, ours and the peers) to ``--out``, prints a short table, and exits non-zero when a
check of ours fails. Each implementation runs in a process of its own, so a CUDA fault costs
that implementation only, and is named. Without a GPU it runs the correctness half on the CPU
backend and says that no timing was taken.

The GPU check of the benchmark harness (``benchmarks/gpu_check.sh``) runs its decisive tier
through this same code.

Modules: ``cells`` (what runs, pure), ``worker`` (one implementation's cells, in a process),
``run`` (compile, workers, faults, report), ``report`` (verdict, files, table), and the device
side the worker uses: ``data`` (a paged pool and its float64 check), ``timing`` (graphs, events,
L2 flush), ``bandwidth`` (the copy ceiling), ``peers`` (SDPA, FlashInfer).
"""

from __future__ import annotations

from typing import Optional, Sequence

from .. import hf_config
from ..config import ModelShape
from ..models import MODELS
from ..precompile import Layer, layers_of
from ..hf_config import shard_heads
from .run import CheckOptions, compile_kernels, run_check

__all__ = ["CheckOptions", "run_check", "model_layers", "compile_kernels"]


def _spelled_shape(name: str) -> ModelShape:
    """``32/8/128`` (q heads / KV heads / head dim) as a shape; a ValueError names ``--model``."""
    try:
        q, kv, d = (int(x) for x in name.split("/"))
    except ValueError:
        raise ValueError(f"--model takes {', '.join(sorted(MODELS))} or Q/KV/HEAD_DIM (32/8/128); got {name!r}") \
            from None
    if min(q, kv, d) < 1:
        raise ValueError(f"--model {name}: heads and head dim must be >= 1")
    return ModelShape(q, kv, d)


def model_layers(models: Sequence[str] = (), hf_config_path: Optional[str] = None,
                 tensor_parallel: int = 1) -> tuple[str, list[Layer]]:
    """(label, one rank's layer kinds) of ``--model NAME[,NAME...]`` or ``--hf-config FILE`` (one of
    the two), at ``tensor_parallel`` ranks. A ValueError names the flag."""
    if bool(models) == (hf_config_path is not None):
        raise ValueError("give the model with --model (" + ", ".join(sorted(MODELS)) + ") or --hf-config "
                         "config.json, one of the two")
    if hf_config_path is not None:
        model = hf_config.load(hf_config_path)
        return f"{model.source} ({model.model_type or 'no model_type'}, TP {tensor_parallel})", \
            layers_of(model, tensor_parallel)
    layers = []
    for name in models:
        shape = MODELS.get(name) or _spelled_shape(name)
        q, kv = shard_heads(shape.num_q_heads, shape.num_kv_heads, tensor_parallel)
        layers.append(Layer(name, q, kv, shape.head_dim))
    return ", ".join(models) + (f" (TP {tensor_parallel})" if tensor_parallel != 1 else ""), layers
