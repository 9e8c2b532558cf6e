"""The Llama family's typed config (`conf/model/<preset>.yaml` with `defaults: [base_model_llama]`).

Pure Python: base/schema.py registers it with Hydra before anything heavy is imported.
"""
from dataclasses import dataclass, field

from omegaconf import MISSING

from base.family import FamilyConfig
from models.common.rope import RopeScalingConfig


@dataclass
class LlamaConfig(FamilyConfig):
    family: str = "llama"  # models/llama/: decoder-only, causal
    impl: str = "native"  # native (models/llama/model.py) | mindformers (MindFormers 1.9 LlamaForCausalLM)
    num_kv_heads: int = MISSING  # == num_heads: multi-head attention; fewer: grouped-query attention
    intermediate_size: int = MISSING  # SwiGLU width
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
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
    # query rows per attention block (0: all S at once); with recompute=selective only one block's scores are
    # alive at a time: long sequences on CPU (model.py CoreAttention)
    attention_chunk: int = 0
