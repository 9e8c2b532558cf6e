"""A trained model to generate with, from a mindlab checkpoint or a Hugging Face directory: what `python -m generate`,
builders/preferences.py (on-policy pairs) and the generation benchmarks load, as a library (the command lines stay
thin). Nothing here sets MindSpore's process-wide context: the caller does (graph_mode).

    model_cfg, path, tokenizer = load(source, workdir)   # checks; a Hugging Face directory converted into workdir
    graph_mode(device)                                  # the entry point's choice
    model = build(model_cfg, path, device, precision)   # the weights read: workdir may go
"""
import os

from omegaconf import OmegaConf

from base.errors import UsageError
from models import family
from models.generation import generates


def graph_mode(device: str) -> None:
    """MindSpore's graph mode on `device`, as generation runs (its cells compile once per shape): the entry points
    call it, before build."""
    import mindspore as ms

    ms.set_context(mode=ms.GRAPH_MODE)
    if ms.get_context("device_target") != device:
        ms.set_device(device)


def checkpoint_dir(source: str) -> str:
    """The directory holding config.yaml + model.safetensors (a run, its checkpoints/ or `latest` followed:
    base/checkpoint.py resolve), or an HF dir."""
    from base.checkpoint import resolve

    if not os.path.exists(source):
        raise UsageError(f"CKPT_OR_HF_DIR: no such directory: {source}")
    return resolve(source)


def load(source: str, workdir: str):
    """(model config, path of the mindlab weights directory, tokenizer) of a checkpoint or an HF directory."""
    from data.tokenizer import Tokenizer
    from models.convert import import_hf

    path = checkpoint_dir(source)
    if not os.path.isfile(os.path.join(path, "config.yaml")) and os.path.isfile(os.path.join(path, "config.json")):
        try:
            import_hf(path, workdir)  # a Hugging Face directory: the same path as `models.convert --to mindlab`
        except KeyError as err:
            raise UsageError(f"{path}/config.json: has no {err} (not a Llama config)") from None
        path = workdir
    for name in ("config.yaml", "model.safetensors"):
        if not os.path.isfile(os.path.join(path, name)):
            raise UsageError(f"CKPT_OR_HF_DIR: {path} has no {name}: neither a mindlab checkpoint (config.yaml + "
                             f"model.safetensors + tokenizer.model) nor a Hugging Face model (config.json)")
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        raise UsageError(f"CKPT_OR_HF_DIR: {path} holds LoRA adapters only; merge them first: "
                         f"python -m models.convert {path} --to mindlab OUT --merge-lora")
    if not os.path.isfile(os.path.join(path, "tokenizer.model")):
        raise UsageError(f"CKPT_OR_HF_DIR: {source} has no tokenizer.model (a sentencepiece model is needed)")
    cfg = OmegaConf.load(os.path.join(path, "config.yaml"))

    name = OmegaConf.select(cfg, "model.family", default="llama")
    if not generates(name):
        raise UsageError(f"CKPT_OR_HF_DIR: {source} is model.family={name}, which has no generator (the family "
                         f"hook `generator(model)` in models/{name}/: a causal decoder's)")
    model_cfg = OmegaConf.merge(OmegaConf.structured(family(name).Config), cfg.model)
    tokenizer = Tokenizer(os.path.join(path, "tokenizer.model"))
    if tokenizer.vocab_size > model_cfg.vocab_size:
        raise UsageError(f"CKPT_OR_HF_DIR: tokenizer.model has {tokenizer.vocab_size} pieces, more than the "
                         f"model's vocab_size={model_cfg.vocab_size}")
    return model_cfg, path, tokenizer


def build(model_cfg, path: str, device: str, precision: str = "auto"):
    """The model to generate with, in `precision`'s compute dtype (auto: the device's, fp32 on CPU), on `device`
    (the MindSpore context's: the caller sets it, graph_mode)."""
    from base import checkpoint
    from models import build_model

    # the native model (MindFormers' checkpoints hold the same names), built as training builds it: with the CPU
    # kernels where they apply, so decoding runs one attention op a layer and step (kernels/attention.cc)
    # (`impl` only where the family has one: the llama family's choice of native or MindFormers' network)
    plain = {"flash_attention": False, "recompute": "none", **({"impl": "native"} if "impl" in model_cfg else {})}
    native = OmegaConf.merge(model_cfg, plain)
    dtype = precision if precision != "auto" else ("fp32" if device == "CPU" else "bf16")
    model = build_model(native, native.max_position_embeddings, dtype, device, seed=0)
    checkpoint.load_weights(path, model)
    model.set_train(False)
    return model
