"""The mixture-of-experts family: Llama's decoder (models/common/ blocks) with a routed feed-forward: top-k of E
SwiGLU experts per token (Mixtral), fine-grained experts and a shared expert (Qwen2-MoE, DeepSeek-MoE), dropless
or with a capacity factor, the load-balancing loss and router z-loss added to the objective's loss through the
causal-LM interface (models/common/causal_lm.py).

    config.py      MoeConfig, the typed `model` group      model.py   MoeForCausalLM
    accounting.py  parameters (total and active) and FLOPs  hf.py      Mixtral / Qwen2-MoE names and config.json
    plan.py        tensor/pipeline/expert parallel plan     mindformers.py  MindFormers' export (moe_config)

LoRA (peft=lora) adapts the linear cells its target_modules match: by default the attention projections (the
routed experts are stacked Parameters, not linear cells; the router and the shared expert only when named, e.g.
peft.target_modules=[attention.wq,attention.wv,feed_forward.shared_expert.w1]). plan.py lays it out over tp, pp,
cp and ep. Importing this package is cheap (no MindSpore).
"""
from base.errors import require
from base.schema import use_flash_attention
from models.common.checks import check_attention_shape
from models.moe import hf
from models.moe.accounting import flops_per_token, layer_activation_factors, linear_shapes, \
    matmul_parameter_count, parameter_count, stage_parameters
from models.moe.config import MoeConfig as Config

__all__ = ["Config", "after_step", "attention_kind", "build", "check", "describe", "export_mindformers",
           "flops_per_token", "generator", "hf",
           "layer_activation_factors", "linear_shapes", "matmul_parameter_count", "parameter_count",
           "recompute_cells", "stage_parameters", "step_metrics", "experts"]
CAUSAL = True


def build(cfg: Config, seq_len: int, compute_dtype: str, use_flash: bool, seed: int, sharded: bool = False):
    """tokens [B, S] -> fp32 logits [B, S, vocab]; a CausalLM whose loss adds the routers' auxiliary loss.
    `sharded`: weights initialised by the sharded compile, each rank its slices."""
    from models.moe.model import MoeForCausalLM

    return MoeForCausalLM(cfg, compute_dtype, use_flash, seed, deferred=sharded)


def attention_kind(cfg: Config, device_target: str, compute_dtype: str, sharded: bool) -> str:
    """flash (Ascend's flash attention) or plain: no CPU kernel twins for this family."""
    return "flash" if use_flash_attention(cfg, device_target) else "plain"


def recompute_cells(model, mode: str) -> list:
    """full: each decoder layer; selective: the attention core's scores/softmax block."""
    from models.common.attention import CoreAttention

    if mode == "full":
        return list(model.layers())
    cores = [layer.attention.core for layer in model.layers()]
    return [core.block if isinstance(core, CoreAttention) else core for core in cores]


def check(cfg) -> None:
    """Rules of this family's keys (base/validate.py calls it; each failure names the key)."""
    m, p = cfg.model, cfg.parallel
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "num_experts", "top_k",
                "expert_intermediate_size"):
        require(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
    require(m.top_k <= m.num_experts, "model.top_k",
            f"top_k={m.top_k} exceeds num_experts={m.num_experts} (a token's experts are distinct); set "
            f"model.top_k <= {m.num_experts}")
    require(m.capacity_factor is None or m.capacity_factor > 0, "model.capacity_factor",
            f"must be > 0 (each expert's room, in units of an even share of the routed tokens) or null for "
            f"dropless, got {m.capacity_factor}")
    require(m.shared_expert_intermediate_size >= 0, "model.shared_expert_intermediate_size",
            f"must be >= 0 (0: no shared expert), got {m.shared_expert_intermediate_size}")
    require(not m.shared_expert_gate or m.shared_expert_intermediate_size > 0, "model.shared_expert_gate",
            "gates the shared expert; set model.shared_expert_intermediate_size > 0 or shared_expert_gate=false")
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        require(m[key] >= 0, f"model.{key}", f"must be >= 0 (0: off), got {m[key]}")
    require(m.bias_update_rate == 0 or p.dp * p.tp * p.pp * p.cp == 1 or cfg.dry_run, "model.bias_update_rate",
            "moves the routing bias by one device's expert load (on the host after each step); train on one device "
            "(parallel=single) or set model.bias_update_rate=0")
    require(m.rope_scaling.type == "none", "model.rope_scaling.type",
            f"{m.rope_scaling.type}: long-context RoPE scaling is the llama family's; set model.rope_scaling.type=none")
    require(m.attention_chunk >= 0, "model.attention_chunk", f"must be >= 0 (0: off), got {m.attention_chunk}")
    check_attention_shape(m)
    for key, size in (("expert_intermediate_size", m.expert_intermediate_size),
                      ("shared_expert_intermediate_size", m.shared_expert_intermediate_size)):
        require(size % p.tp == 0, f"model.{key}", f"{size} is not divisible by parallel.tp={p.tp} (tensor "
                f"parallelism splits each expert's width, models/moe/plan.py); choose a tp that divides it")


def describe(m, count) -> list:
    """Dry-run lines: the shape, total and active parameters, where they are."""
    c = parameter_count(m)
    shared = (f", shared expert {m.shared_expert_intermediate_size}{' (gated)' if m.shared_expert_gate else ''}"
              if m.shared_expert_intermediate_size else "")
    room = "dropless" if m.capacity_factor is None else f"capacity factor {m.capacity_factor:g}"
    return [f"  vocab {m.vocab_size}, hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads "
            f"({m.num_kv_heads} kv, head dim {m.hidden_size // m.num_heads})",
            f"  experts     {m.num_experts} x ffn {m.expert_intermediate_size}, top {m.top_k} "
            f"({'renormalised' if m.norm_topk_prob else 'softmax weights'}){shared}, {room}",
            f"  active      {count(c['active'])} of {count(c['total'])} per token",
            f"  embedding   {count(c['embedding'])}",
            f"  layers      {count(c['layers'])} = {m.num_layers} x {count(c['per_layer'])} "
            f"(experts {count(c['experts_per_layer'])})",
            f"  lm head     {'tied to the embedding' if m.tie_embeddings else count(c['lm_head'])}"]


def export_mindformers(cfg, weights: dict, out_dir: str, location=None) -> None:
    """MindFormers' LlamaForCausalLM with a moe_config: its .ckpt and run YAML (models/moe/mindformers.py)."""
    from models.moe.mindformers import export_checkpoint

    export_checkpoint(cfg, weights, out_dir, location)


def experts(m) -> tuple:
    """(num_experts, top_k): parallel.ep splits the experts (base/validate.py, planner/)."""
    return m.num_experts, m.top_k


def generator(model):
    """The KV-cache generator of models/common/generation.py (dropless routing at inference)."""
    from models.common.generation import generator as common_generator

    return common_generator(model)


def after_step(model, cfg) -> None:
    """DeepSeek-V3's routing-bias update (model.bias_update_rate > 0) from the step's expert load."""
    if cfg.bias_update_rate > 0:
        from models.moe.model import update_routing_bias

        update_routing_bias(model, cfg.bias_update_rate)


def step_metrics(model) -> dict:
    """The last step's router statistics (models/moe/model.py STATS): the load-balancing loss and z-loss before
    their coefficients, the busiest expert's assignments over the mean, the share of assignments dropped."""
    from models.moe.model import STATS

    stats = next(p for p in model.get_parameters() if p.name.endswith("router_stats"))
    return dict(zip(STATS, (float(v) for v in stats.asnumpy())))
