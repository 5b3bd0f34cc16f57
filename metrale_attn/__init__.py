"""metrale-attn: paged-decode attention with a batch-invariant split-K policy."""

from .attention import DecodeAttention, StreamReuseWarning, workspace_bytes
from .plan import DecodePlan, ModelShape
from .policy import SplitkPolicy

__all__ = ["DecodeAttention", "DecodePlan", "ModelShape", "SplitkPolicy", "StreamReuseWarning", "workspace_bytes"]
__version__ = "0.1.0"
