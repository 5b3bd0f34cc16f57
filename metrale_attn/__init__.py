"""metrale-attn: paged-decode attention with a batch-invariant split-K policy."""
