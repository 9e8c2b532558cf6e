"""The checkpoint's model as evaluation runs it: its weights (a LoRA checkpoint: its base plus its adapters),
in inference mode."""
import os

from omegaconf import DictConfig, OmegaConf


def load_model(cfg: DictConfig, ckpt: str):
    """The checkpoint's model (a LoRA checkpoint: its base at stage.init_from plus its adapters)."""
    from base import checkpoint
    from models import build_model

    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device.target,
                        cfg.trainer.seed)
    saved = OmegaConf.load(os.path.join(ckpt, "config.yaml"))
    peft = saved.get("peft") or {}
    if peft.get("name", "none") != "none":
        from adapters.lora import apply_lora, lora_state

        if saved.stage.init_from:  # the base the adapters were trained on: the same tokenizer, the same shapes
            checkpoint.check_same_tokenizer("checkpoint", f"the LoRA checkpoint {ckpt}", checkpoint.tokenizer_of(ckpt),
                                            f"its base {saved.stage.init_from}",
                                            checkpoint.tokenizer_of(saved.stage.init_from))
            checkpoint.load_weights(saved.stage.init_from, model)
        apply_lora(model, peft, cfg.trainer.seed)
        checkpoint.load_weights(ckpt, model, only=set(lora_state(model)))
    else:
        checkpoint.load_weights(ckpt, model)
    model.set_train(False)
    return model
