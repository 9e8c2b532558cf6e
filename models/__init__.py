"""Model zoo: `build_model` turns `cfg.model` into a MindSpore cell mapping tokens [B, S] to fp32 logits."""
from conf.schema import ModelConfig


def use_flash_attention(cfg: ModelConfig, device_target: str) -> bool:
    """null (auto) picks the fused kernel where it exists (Ascend); validation refuses `true` elsewhere."""
    if cfg.flash_attention is None:
        return device_target == "Ascend"
    return cfg.flash_attention


def apply_recompute(model, mode: str) -> None:
    """full: recompute each decoder layer in backward; selective: only the attention core (scores/softmax)."""
    if mode == "none":
        return
    for layer in _decoder_layers(model):
        if mode == "full":
            layer.recompute()
        else:
            layer.attention.core.recompute()


def _decoder_layers(model):
    from models.mindformers_llama import MindFormersLlama

    if isinstance(model, MindFormersLlama):
        return model.net.model.layers
    return model.model.layers


def build_model(cfg: ModelConfig, seq_len: int, compute_dtype: str, device_target: str, seed: int):
    flash = use_flash_attention(cfg, device_target)
    if cfg.impl == "mindformers":
        from models.mindformers_llama import MindFormersLlama

        model = MindFormersLlama(cfg, seq_len, compute_dtype, flash, seed)
    else:
        from models.llama import LlamaForCausalLM

        model = LlamaForCausalLM(cfg, compute_dtype, flash, seed)
    apply_recompute(model, cfg.recompute)
    return model
