"""Convert mindlab checkpoints to Hugging Face (and, for Llama, MindFormers), and Hugging Face back.

    python -m models.convert runs/a/checkpoints/step_000400 --to hf out/hf_model
    python -m models.convert runs/rm/checkpoints/step_000300 --to hf out/rm    # LlamaForSequenceClassification
    python -m models.convert runs/a/checkpoints/step_000400 --to mindformers out/mf_model
    python -m models.convert out/hf_model --to mindlab out/init     # then: train.py stage.init_from=out/init
    python -m models.convert runs/sft/checkpoints/step_000500 --to hf out/adapter             # a LoRA run: PEFT adapter
    python -m models.convert runs/sft/checkpoints/step_000500 --to hf out/hf --merge-lora     # W += B A alpha/r
    python -m models.convert runs/sft/checkpoints/step_000500 --to mindlab out/merged --merge-lora

Each model family's own adapter (`models/<family>/hf.py`) knows its names and config.json; this file only
reads and writes the files. An HF directory is imported by the family whose adapter lists its architecture.
"""
import functools
import json
import os
import shutil
import sys
from argparse import RawDescriptionHelpFormatter
from typing import Optional

import numpy as np
from omegaconf import OmegaConf

from base.checkpoint import ADAPTERS, CheckpointError, resolve
from base.outputs import output_dir
from data.samples import chat_template, template_of
from base.errors import ArgumentParser, UsageError, entry_point
from models import FAMILIES, family

REWARD_HEAD = "score.weight"  # the scalar head a reward model adds to the decoder (objectives/rm.py)


def _read_checkpoint(ckpt_dir: str):
    if not os.path.isdir(ckpt_dir):
        raise UsageError(f"{ckpt_dir}: no such directory; give a checkpoint directory (.../checkpoints/step_N)")
    for name in ("config.yaml", "model.safetensors"):
        if not os.path.isfile(os.path.join(ckpt_dir, name)):
            raise CheckpointError(f"{ckpt_dir}: has no {name}, so it is not a mindlab checkpoint; give a "
                                  f"checkpoint directory (.../checkpoints/step_N), or --to mindlab for an HF model")
    return OmegaConf.load(os.path.join(ckpt_dir, "config.yaml")), _load_safetensors(os.path.join(ckpt_dir,
                                                                                                 "model.safetensors"))


def _load_safetensors(file: str) -> dict:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{file}: cannot be read ({err}); the file is truncated or not safetensors: "
                              f"copy it again or use an earlier checkpoint") from None


def _lora_base(ckpt_dir: str, cfg) -> str:
    """The checkpoint directory a LoRA checkpoint's adapters sit on (its stage.init_from, resolved)."""
    base = cfg.stage.init_from
    base = resolve(base) if base else base
    directory = os.path.dirname(base) if base and base.endswith(".safetensors") else base
    if not directory or not os.path.isfile(os.path.join(directory, "model.safetensors")):
        raise CheckpointError(f"{ckpt_dir} holds LoRA adapters only; their base, stage.init_from={base}, is not "
                              f"there: restore it (or point the checkpoint's config.yaml at it)")
    return directory


def _read_weights(ckpt_dir: str, merge_lora: bool):
    """(config, weights) of a checkpoint; a LoRA checkpoint's adapters merged into its base (stage.init_from)
    when `merge_lora`, else returned as they are (then the caller writes an adapter)."""
    cfg, weights = _read_checkpoint(ckpt_dir)
    if not os.path.isfile(os.path.join(ckpt_dir, ADAPTERS)) or not merge_lora:
        return cfg, weights
    from adapters.lora import merge_lora as merge

    file = os.path.join(_lora_base(ckpt_dir, cfg), "model.safetensors")
    return OmegaConf.merge(cfg, {"peft": {"name": "none"}}), merge({**_load_safetensors(file), **weights}, cfg.peft)


def model_family(cfg):
    """The family module of a checkpoint's config (checkpoints written before families existed are Llama)."""
    return family(OmegaConf.select(cfg, "model.family", default="llama"))


def export_hf(ckpt_dir: str, out_dir: str, merge_lora: bool = False, location: Optional[str] = None) -> None:
    """A Hugging Face model directory; with `merge_lora` a LoRA checkpoint's merged model; else from a LoRA
    checkpoint its adapters in PEFT's format, self-contained: the base exported beside them (out_dir/base/, which
    adapter_config.json's base_model_name_or_path names) and the tokenizer, so that
    `AutoPeftModelForCausalLM.from_pretrained(out_dir)` loads it. `location`: where out_dir will be once in place
    (the CLI writes into a temporary directory first), for that absolute path."""
    from safetensors.numpy import save_file

    cfg, weights = _read_weights(ckpt_dir, merge_lora)
    weights = {k: v for k, v in weights.items() if not k.startswith("value_head.")}  # a PPO policy's critic
    adapter = model_family(cfg).hf
    tokenizer = os.path.join(ckpt_dir, "tokenizer.model")
    if os.path.isfile(os.path.join(ckpt_dir, ADAPTERS)) and not merge_lora:
        from adapters.lora import peft_adapter_files, single_name, write_peft_adapter

        base = os.path.join(out_dir, "base")
        export_hf(_lora_base(ckpt_dir, cfg), base)
        write_peft_adapter(out_dir, *peft_adapter_files(weights, cfg.peft, single_name(adapter.to_hf),
                                                        os.path.abspath(os.path.join(location or out_dir, "base"))))
        if os.path.exists(tokenizer):  # with the template the adapters were trained on, as the merged export has
            adapter.save_tokenizer(tokenizer, out_dir, chat_template(template_of(cfg)))
        return
    os.makedirs(out_dir, exist_ok=True)
    save_file(adapter.to_hf(weights), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        config = adapter.hf_config(cfg.model)
        if REWARD_HEAD in weights:  # a reward model (objectives/rm.py): the decoder and a scalar head
            config.update(adapter.REWARD_MODEL)
        json.dump(config, f, indent=2)
    if os.path.exists(tokenizer):
        adapter.save_tokenizer(tokenizer, out_dir, chat_template(template_of(cfg)))
    if adapter.save_generation_config is not None:  # a family that generates
        adapter.save_generation_config(cfg.model, out_dir)


def export_mindformers(ckpt_dir: str, out_dir: str, location: Optional[str] = None) -> None:
    """A MindFormers `.ckpt` and the model part of a MindFormers run YAML, by the family's `export_mindformers`
    hook (Llama's, and the MoE family's as MindFormers' Llama with a moe_config). `location`: where out_dir will be
    once in place, for the YAML's load_checkpoint."""
    cfg, weights = _read_checkpoint(ckpt_dir)
    fam = model_family(cfg)
    if fam.export_mindformers is None:
        raise UsageError(f"{ckpt_dir}: --to mindformers: model.family={cfg.model.family} has no MindFormers "
                         "counterpart; use --to hf")
    fam.export_mindformers(cfg, weights, out_dir, location)
    tokenizer = os.path.join(ckpt_dir, "tokenizer.model")
    if os.path.exists(tokenizer):
        shutil.copy(tokenizer, out_dir)


def merge_to_mindlab(ckpt_dir: str, out_dir: str) -> None:
    """A LoRA checkpoint merged into its base: a plain weights directory usable as `stage.init_from`."""
    from safetensors.numpy import save_file

    cfg, weights = _read_weights(ckpt_dir, merge_lora=True)
    os.makedirs(out_dir, exist_ok=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"))
    OmegaConf.save(cfg, os.path.join(out_dir, "config.yaml"))
    if os.path.exists(os.path.join(ckpt_dir, "tokenizer.model")):
        shutil.copy(os.path.join(ckpt_dir, "tokenizer.model"), out_dir)


def import_hf(hf_dir: str, out_dir: str) -> None:
    """A Hugging Face model directory -> a mindlab weights directory usable as `stage.init_from`."""
    from safetensors.numpy import save_file

    where = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(where):
        raise UsageError(f"{hf_dir}: has no config.json, so it is not a Hugging Face model directory")
    try:
        with open(where, encoding="utf-8") as f:
            hf = json.load(f)
    except (ValueError, OSError) as err:
        raise CheckpointError(f"{where}: cannot be read as JSON ({err}); download the model again") from None
    architectures = hf.get("architectures") or []
    owners = [name for name in FAMILIES if set(architectures) & set(family(name).hf.ARCHITECTURES)]
    if not owners:
        known = ", ".join(a for name in FAMILIES for a in family(name).hf.ARCHITECTURES)
        raise UsageError(f"{where}: architectures {architectures} are not supported; mindlab imports {known}")
    fam = family(owners[0])
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{hf_dir}: no .safetensors weights; convert .bin files with transformers first")
    weights = {}
    for name in files:
        weights.update({k: v.astype(np.float32) for k, v in _load_safetensors(os.path.join(hf_dir, name)).items()})
    os.makedirs(out_dir, exist_ok=True)
    save_file(fam.hf.from_hf(weights, hf), os.path.join(out_dir, "model.safetensors"))
    model = OmegaConf.merge(OmegaConf.structured(fam.Config),
                            {"name": os.path.basename(os.path.normpath(hf_dir)), **fam.hf.config_from_hf(hf, where)})
    OmegaConf.save(OmegaConf.create({"model": model}), os.path.join(out_dir, "config.yaml"))
    if os.path.exists(os.path.join(hf_dir, "tokenizer.model")):
        shutil.copy(os.path.join(hf_dir, "tokenizer.model"), out_dir)


@entry_point
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m models.convert", description=__doc__,
                            formatter_class=RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a mindlab checkpoint dir, or a Hugging Face model dir with --to mindlab")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--to", choices=["hf", "mindformers", "mindlab"], required=True)
    parser.add_argument("--merge-lora", action="store_true",
                        help="a LoRA checkpoint: merge its adapters into its base (W += B A alpha/r) first")
    args = parser.parse_args(argv)
    if args.to == "hf":
        export = functools.partial(export_hf, merge_lora=args.merge_lora, location=args.out)
    elif args.to == "mindlab" and args.merge_lora:
        export = merge_to_mindlab
    else:
        export = {"mindformers": functools.partial(export_mindformers, location=args.out), "mindlab": import_hf}[args.to]
    with output_dir(args.out, "models.convert") as tmp:  # a new directory, or a previous export, replaced whole
        export(resolve(args.source), str(tmp))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
