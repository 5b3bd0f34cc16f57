"""metrale-attn: paged-decode attention with a batch-invariant split-K policy."""

from . import logs
from .attention import DecodeAttention, StreamReuseWarning
from .config import LayerConfig, ModelShape
from .merge import merge_states
from .plan import DecodePlan
from .policy import SplitkPolicy
from .workspace import workspace_bytes

__all__ = ["DecodeAttention", "DecodePlan", "LayerConfig", "ModelShape", "SplitkPolicy", "StreamReuseWarning",
           "merge_states", "workspace_bytes"]
__version__ = "0.1.0"

logs.configure()  # METRALE_ATTN_LOG_LEVEL: read once, here (see metrale_attn/logs.py)
