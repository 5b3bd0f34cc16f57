"""Package data: the simt reference kernels (shipped inside the wheel as metrale_attn/kernels_cu/simt)."""
