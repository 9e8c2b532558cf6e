"""The checkpoint's model as evaluation runs it: its weights (a LoRA checkpoint: its base plus its adapters),
in inference mode."""
import os

from omegaconf import DictConfig, OmegaConf


def load_model(cfg: DictConfig, ckpt: str):
    """The checkpoint's model (a LoRA checkpoint: its base at stage.init_from plus its adapters)."""
    from base import checkpoint
    from models import build_model

    model = build_model(cfg.model, cfg.data.seq_len, cfg.precision.compute_dtype, cfg.device,
                        cfg.trainer.seed)
    saved = OmegaConf.load(os.path.join(ckpt, "config.yaml"))
    peft = saved.get("peft") or {}
    if peft.get("name", "none") != "none":
        from adapters import method

        if saved.stage.init_from:  # the base the adapters were trained on: the same tokenizer, the same shapes
            checkpoint.check_same_tokenizer("checkpoint", f"the LoRA checkpoint {ckpt}", checkpoint.tokenizer_of(ckpt),
                                            f"its base {saved.stage.init_from}",
                                            checkpoint.tokenizer_of(saved.stage.init_from))
            checkpoint.load_weights(saved.stage.init_from, model)
        run = OmegaConf.create({"peft": peft, "model": {"family": cfg.model.family},  # what a PEFT method's apply reads
                                "trainer": {"seed": cfg.trainer.seed}, "stage": {"init_from": saved.stage.init_from}})
        adapters = method(peft.name).apply(model, run)
        checkpoint.load_weights(ckpt, model, only=adapters.names)
    else:
        checkpoint.load_weights(ckpt, model)
    model.set_train(False)
    return model
