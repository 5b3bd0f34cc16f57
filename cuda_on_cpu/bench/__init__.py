"""The CUDA-on-CPU shim's speed scripts (not shipped; run from the repository root):

- ``speed``: fiber switches, barriers and warp shuffles, the x86-64 switch against ``ucontext``
- ``ptx_speed``: the cost of one emulated ``mma``, ``ldmatrix.x4`` and ``cp.async`` (metrale-attn's
  ``kernels_cu/pd_ptx.cuh``, read as a file)
"""
