"""The frozen reference model of DPO and PPO: the starting weights, kept fixed while the policy trains.

    copy         a second model holding a copy of the policy's weights as they are now, its parameters named
                 "reference." + name (one graph may hold both models)
    lora_base    with peft=lora: a model without adapters whose cells hold the policy's own frozen base
                 Parameters (the same objects): no second copy in memory, exactly the starting model while the
                 LoRA B matrices start at zero
    precomputed  no reference model while training: before the first step the starting model (the policy as
                 attach() receives it) scores every pair once, and each batch carries those numbers as inputs
                 (objectives/dpo.py; TRL's precompute_ref_log_probs). Only for an objective whose sequences are
                 known before training: PPO samples its own, so it takes copy or lora_base

and `token_logps`, the log-probabilities both objectives compare policy and reference on.
"""
import mindspore as ms
from mindspore import Tensor, nn, ops

MODES = ("copy", "lora_base", "precomputed")


def token_logps(logits, tokens):
    """(log-probabilities [B, S] of `tokens` [B, S] under `logits` [B, S, vocab], all log-probabilities
    [B, S, vocab]), fp32: what policy and reference are compared on."""
    logp = ops.log_softmax(logits.astype(ms.float32), -1)
    return ops.gather_elements(logp, 2, tokens.expand_dims(-1)).squeeze(-1), logp


def check(cfg, key: str, modes=MODES) -> None:
    """`modes`: those the objective supports (PPO cannot precompute: it samples its sequences while training)."""
    from base.errors import require

    mode = cfg.objective.reference
    require(mode in modes, key, f"got {mode!r}; objective={cfg.objective.name} takes one of {', '.join(modes)}")
    require(mode != "lora_base" or cfg.peft.name == "lora", key,
            "lora_base is the frozen base of a LoRA policy; set peft=lora, or objective.reference=copy")


def build_reference(policy: nn.Cell, cfg, mode: str) -> nn.Cell:
    """A frozen model equal to `policy` now (built as cfg.model says), in eval mode (`mode` copy or lora_base)."""
    from base.schema import is_sharded
    from models import build_model

    reference = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device,
                            cfg.trainer.seed, is_sharded(cfg.parallel))
    weights = {p.name: p for p in policy.get_parameters()}
    if mode == "lora_base":
        for _, cell in reference.cells_and_names():
            for key, param in list(cell._params.items()):
                cell._params[key] = weights[param.name]  # the same Parameter: frozen under LoRA
    else:
        for param in reference.get_parameters():
            param.set_data(Tensor(weights[param.name].asnumpy()))
            param.requires_grad = False
        reference.update_parameters_name("reference.")
    reference.set_train(False)
    return reference


def memory_rows(cfg) -> tuple:
    """The dry-run planner's row for the reference (planner/memory.py ObjectiveMemory.extra)."""
    from models import family

    if cfg.objective.reference == "copy":
        params = family(cfg.model.family).parameter_count(cfg.model)["total"]
        return (("reference (frozen)", 4.0 * params, "a second fp32 copy of the starting weights"),)
    return ()  # lora_base: the policy's own Parameters; precomputed: no reference while training
