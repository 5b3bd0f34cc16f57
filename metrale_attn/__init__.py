"""metrale-attn: paged-decode attention with a batch-invariant split-K policy."""

from .attention import DecodeAttention, StreamReuseWarning, workspace_bytes
from .merge import merge_states
from .plan import DecodePlan, ModelShape
from .policy import SplitkPolicy

__all__ = ["DecodeAttention", "DecodePlan", "ModelShape", "SplitkPolicy", "StreamReuseWarning", "merge_states",
           "workspace_bytes"]
__version__ = "0.1.0"
