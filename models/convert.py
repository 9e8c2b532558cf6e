"""Convert mindlab checkpoints to Hugging Face `LlamaForCausalLM` and MindFormers, and Hugging Face back.

    python -m models.convert runs/a/checkpoints/step_000400 --to hf out/hf_model
    python -m models.convert runs/a/checkpoints/step_000400 --to mindformers out/mf_model
    python -m models.convert out/hf_model --to mindlab out/init     # then: train.py stage.init_from=out/init

mindlab's parameter names are MindFormers' Llama names, so the MindFormers export renames nothing. The
Hugging Face names differ only by the table below; shapes are equal ([out, in] linear weights) and both
use the "rotate half" RoPE pairing, so no weight is permuted. NTK-scaled RoPE (a raised base) is exported
as the raised `rope_theta` itself, which is the same function.
"""
import argparse
import os
import re
import shutil
from typing import Dict

import numpy as np
from omegaconf import OmegaConf

HF_NAMES = {  # mindlab / MindFormers -> Hugging Face; {i} is the layer index
    "model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
    "model.layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "model.layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "model.layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.feed_forward.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "model.layers.{i}.feed_forward.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "model.layers.{i}.feed_forward.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "model.layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "model.norm_out.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}
# special token ids of data/tokenizer.py's sentencepiece models
PAD_ID, BOS_ID, EOS_ID = 0, 2, 3  # unk is 1


def _rename(name: str, table: Dict[str, str]) -> str:
    for source, target in table.items():
        match = re.fullmatch(re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if match:
            return target.format(**match.groupdict())
    raise ValueError(f"no conversion rule for parameter {name!r}")


def to_hf_names(weights: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    return {_rename(k, HF_NAMES): v for k, v in weights.items()}


def from_hf_names(weights: Dict[str, np.ndarray], tied: bool) -> Dict[str, np.ndarray]:
    """A tied Hugging Face model may still store lm_head.weight (a copy of the embedding): dropped."""
    back = {hf: ml for ml, hf in HF_NAMES.items()}
    return {_rename(k, back): v for k, v in weights.items() if not (tied and k == "lm_head.weight")}


def _read_checkpoint(ckpt_dir: str):
    from safetensors.numpy import load_file

    cfg = OmegaConf.load(os.path.join(ckpt_dir, "config.yaml"))
    return cfg, load_file(os.path.join(ckpt_dir, "model.safetensors"))


def hf_config(m) -> dict:
    """Hugging Face LlamaConfig fields for a mindlab ModelConfig."""
    head_dim = m.hidden_size // m.num_heads
    theta, scaling = m.rope_theta, None
    if m.rope_scaling.type == "ntk":
        theta = theta * m.rope_scaling.factor ** (head_dim / (head_dim - 2))
    elif m.rope_scaling.type == "linear":
        scaling = {"rope_type": "linear", "factor": m.rope_scaling.factor}
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=m.vocab_size,
                hidden_size=m.hidden_size, intermediate_size=m.intermediate_size, num_hidden_layers=m.num_layers,
                num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                max_position_embeddings=m.max_position_embeddings, rms_norm_eps=m.norm_eps, rope_theta=theta,
                rope_scaling=scaling, tie_word_embeddings=m.tie_embeddings, hidden_act="silu",
                attention_bias=False, mlp_bias=False, torch_dtype="float32", pad_token_id=PAD_ID,
                bos_token_id=BOS_ID, eos_token_id=EOS_ID)


def export_hf(ckpt_dir: str, out_dir: str) -> None:
    import json

    from safetensors.numpy import save_file

    cfg, weights = _read_checkpoint(ckpt_dir)
    os.makedirs(out_dir, exist_ok=True)
    save_file(to_hf_names(weights), os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(hf_config(cfg.model), f, indent=2)
    tokenizer = os.path.join(ckpt_dir, "tokenizer.model")
    if os.path.exists(tokenizer):
        from transformers import LlamaTokenizer

        LlamaTokenizer(vocab_file=tokenizer, add_bos_token=False, add_eos_token=False, legacy=False,
                       pad_token="<pad>").save_pretrained(out_dir)


def export_mindformers(ckpt_dir: str, out_dir: str) -> None:
    """A MindFormers `.ckpt` (same parameter names) and the model part of a MindFormers run YAML."""
    import mindspore as ms

    cfg, weights = _read_checkpoint(ckpt_dir)
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "llama.ckpt")
    ms.save_checkpoint([{"name": k, "data": ms.Tensor(v)} for k, v in weights.items()], ckpt)
    m = cfg.model
    yaml = {"load_checkpoint": ckpt, "model": {"arch": {"type": "LlamaForCausalLM"}, "model_config": {
        "type": "LlamaConfig", "seq_length": OmegaConf.select(cfg, "data.seq_len", default=m.max_position_embeddings),
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size, "num_layers": m.num_layers, "num_heads": m.num_heads,
        "n_kv_heads": m.num_kv_heads, "intermediate_size": m.intermediate_size,
        "max_position_embedding": m.max_position_embeddings, "rms_norm_eps": m.norm_eps, "theta": m.rope_theta,
        "extend_method": {"none": "None", "linear": "PI", "ntk": "NTK"}[m.rope_scaling.type],
        "scaling_factor": m.rope_scaling.factor, "tie_word_embeddings": m.tie_embeddings,
        "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
        "compute_dtype": "float16", "param_init_type": "float32", "layernorm_compute_type": "float32",
        "softmax_compute_type": "float32", "rotary_dtype": "float32"}}}
    OmegaConf.save(OmegaConf.create(yaml), os.path.join(out_dir, "llama_mindlab.yaml"))
    tokenizer = os.path.join(ckpt_dir, "tokenizer.model")
    if os.path.exists(tokenizer):
        shutil.copy(tokenizer, out_dir)


def import_hf(hf_dir: str, out_dir: str) -> None:
    """A Hugging Face Llama directory -> a mindlab weights directory usable as `stage.init_from`."""
    import json

    from safetensors.numpy import load_file, save_file

    with open(os.path.join(hf_dir, "config.json"), encoding="utf-8") as f:
        hf = json.load(f)
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"{hf_dir}: no .safetensors weights (convert .bin files with transformers first)")
    weights = {}
    for name in files:
        weights.update({k: v.astype(np.float32) for k, v in load_file(os.path.join(hf_dir, name)).items()})
    tied = bool(hf.get("tie_word_embeddings", False))
    os.makedirs(out_dir, exist_ok=True)
    save_file(from_hf_names(weights, tied), os.path.join(out_dir, "model.safetensors"))
    from conf.schema import ModelConfig

    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), {
        "name": os.path.basename(os.path.normpath(hf_dir)), "vocab_size": hf["vocab_size"],
        "hidden_size": hf["hidden_size"], "num_layers": hf["num_hidden_layers"],
        "num_heads": hf["num_attention_heads"], "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
        "intermediate_size": hf["intermediate_size"], "max_position_embeddings": hf["max_position_embeddings"],
        "norm_eps": hf["rms_norm_eps"], "rope_theta": hf.get("rope_theta", 10000.0), "tie_embeddings": tied})
    scaling = hf.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "linear":
        model.rope_scaling = {"type": "linear", "factor": scaling["factor"]}
    elif scaling:
        raise ValueError(f"{hf_dir}/config.json: rope_scaling {scaling} has no mindlab equivalent")
    OmegaConf.save(OmegaConf.create({"model": model}), os.path.join(out_dir, "config.yaml"))
    if os.path.exists(os.path.join(hf_dir, "tokenizer.model")):
        shutil.copy(os.path.join(hf_dir, "tokenizer.model"), out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a mindlab checkpoint dir, or a Hugging Face model dir with --to mindlab")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--to", choices=["hf", "mindformers", "mindlab"], required=True)
    args = parser.parse_args()
    {"hf": export_hf, "mindformers": export_mindformers, "mindlab": import_hf}[args.to](args.source, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
