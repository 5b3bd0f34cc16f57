"""Package data: the CUDA C kernel sources (shipped inside the wheel as metrale_attn/kernels_cu)."""
