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

from ..precompile import Layer, describe_model
from .run import CheckOptions, compile_kernels, run_check

__all__ = ["CheckOptions", "run_check", "model_layers", "compile_kernels"]


def model_layers(models: Sequence[str] = (), hf_config_path: Optional[str] = None,
                 tensor_parallel: int = 1, **flags) -> tuple[str, list[Layer]]:
    """(label, one rank's layer kinds) of the model the command line describes
    (``precompile.describe_model``: ``--model NAME[,NAME...]``, ``--hf-config FILE`` or one rank's
    shape in ``flags``), at ``tensor_parallel`` ranks. A ValueError names the flags."""
    model = describe_model(models, hf_config_path, tensor_parallel, **flags)
    return model.label, list(model.layers)
