"""The Llama family's typed config (`conf/model/<preset>.yaml` with `defaults: [base_model_llama]`).

Pure Python: base/schema.py registers it with Hydra before anything heavy is imported.
"""
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING


@dataclass
class RopeScalingConfig:
    """Long-context RoPE scaling (models/llama/rope.py has the formulas): the model was pretrained at
    max_position_embeddings positions and serves max_position_embeddings x factor."""
    type: str = "none"  # none | linear | ntk (fixed NTK-aware) | dynamic (dynamic NTK) | yarn | llama3
    factor: float = 1.0  # context extension ratio; > 1 for every type but none
    # yarn: ramp between extrapolation (> beta_fast rotations in the original window) and interpolation
    # (< beta_slow rotations); attention temperature: attention_factor, else from mscale / mscale_all_dim
    # (both set, DeepSeek-V2 style), else 0.1 ln(factor) + 1. truncate: integer ramp bounds (the paper's code).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    # llama3: wavelengths above max_position_embeddings / low_freq_factor are interpolated, below
    # max_position_embeddings / high_freq_factor kept (Llama 3.1: factor 8, 1, 4)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


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
    # without flash attention: fused (kernels/attention.cc: CPU, fp32, blocks of query rows, only the future-free
    # keys computed, no [S, S] array kept), plain (MindSpore ops, model.py CoreAttention), or auto: fused where
    # it applies (CPU, native impl, fp32 compute, no tp/pp, attention_chunk=0, the kernel built by scripts/venv.sh
    # and not switched off by MINDLAB_KERNELS=plain). The fused cells are twins swapped in after the build
    # (models/llama/kernels.py)
    attention_kernel: str = "auto"
    # RMSNorm, SwiGLU, RoPE, the objectives' cross-entropy and the Linears' products: fused (kernels/layers.cc: one
    # pass each, forward and backward; the products on oneDNN's sgemm), plain (MindSpore ops), or auto: fused where
    # it applies (CPU, native impl, fp32 compute, no tp/pp, the kernels built and not switched off)
    layer_kernels: str = "auto"
    recompute: str = "none"  # none | full (whole decoder layer) | selective (attention core only)
    # query rows per attention block (0: all S at once); with recompute=selective only one block's scores are
    # alive at a time: long sequences on CPU (model.py CoreAttention)
    attention_chunk: int = 0
