"""The mixture-of-experts family's typed config (`conf/model/<preset>.yaml` with `defaults: [base_model_moe]`).

A decoder as Llama's (RMSNorm, RoPE, GQA attention) whose feed-forward is a set of SwiGLU experts picked per token
by a router, optionally beside always-on shared experts. Pure Python: base/schema.py registers it before anything
heavy is imported.
"""
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from base.family import FamilyConfig
from models.common.rope import RopeScalingConfig


@dataclass
class MoeConfig(FamilyConfig):
    family: str = "moe"  # models/moe/: decoder-only, causal
    num_kv_heads: int = MISSING  # == num_heads: multi-head attention; fewer: grouped-query attention
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)  # type none only (check())
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    attention_chunk: int = 0  # query rows per attention block (0: all at once), as the Llama family's
    num_experts: int = MISSING  # routed experts per layer
    top_k: int = 2  # experts each token is sent to (Mixtral 2 of 8; Qwen1.5-MoE 4 of 60; DeepSeek-MoE 6 of 64)
    expert_intermediate_size: int = MISSING  # SwiGLU width of one routed expert (fine-grained: a fraction of dense)
    # softmax over all experts, then the top-k; renormalised to sum 1 (Mixtral) or kept as they are
    # (Qwen2-MoE's norm_topk_prob=false, DeepSeek-MoE)
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # always-on SwiGLU of this width beside the routed ones (0: none)
    shared_expert_gate: bool = False  # scale the shared expert by sigmoid(x w) per token (Qwen2-MoE)
    # null: dropless (every routed token is computed: each expert holds room for all tokens); a number c: each
    # expert takes at most ceil(c x tokens x top_k / num_experts) tokens of a micro-batch, the rest dropped
    # (counted, their routed output zero: the residual carries them) as Switch / GShard do
    capacity_factor: Optional[float] = None
    aux_loss_coef: float = 0.01  # load-balancing loss (Switch / Mixtral form) coefficient; 0: off
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE: mean of logsumexp(router logits)^2) coefficient; 0: off
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the routing probabilities for the
    # top-k choice only (the weights stay the unbiased probabilities), moved by this rate gamma after each step
    # towards balance: b_e += gamma x sign(1/E - the share of the step's assignments expert e got); 0: off
    bias_update_rate: float = 0.0
