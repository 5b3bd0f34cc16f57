"""Serving-engine integrations, one subpackage per engine (``vllm``). Each imports its
engine; ``import metrale_attn`` imports none of them."""
