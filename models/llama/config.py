"""The Llama family's typed config (`conf/model/<preset>.yaml` with `defaults: [base_model_llama]`).

Pure Python: conf/schema.py registers it with Hydra before anything heavy is imported.
"""
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class RopeScalingConfig:
    type: str = "none"  # none | linear (position interpolation) | ntk (NTK-aware base scaling)
    factor: float = 1.0


@dataclass
class LlamaConfig:
    name: str = MISSING
    family: str = "llama"  # models/llama/: decoder-only, causal
    impl: str = "native"  # native (models/llama/model.py) | mindformers (MindFormers 1.9 LlamaForCausalLM)
    vocab_size: int = MISSING
    hidden_size: int = MISSING
    num_layers: int = MISSING
    num_heads: int = MISSING
    num_kv_heads: int = MISSING  # == num_heads: multi-head attention; fewer: grouped-query attention
    intermediate_size: int = MISSING  # SwiGLU width
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    flash_attention: Optional[bool] = None  # null: on where the device has the kernel (Ascend); true | false
    recompute: str = "none"  # none | full (whole decoder layer) | selective (attention core only)
