"""Hugging Face `BertForPreTraining` adapter: state dicts and configs.

mindlab's BERT parameter names are Hugging Face's state-dict names and shapes ([out, in] linear weights),
so weights pass through unrenamed. The only differences:
- Hugging Face's state dict also holds the tied MLM decoder, `cls.predictions.decoder.weight` (the word
  embedding) and `cls.predictions.decoder.bias` (`cls.predictions.bias`): added on export, dropped on import
  (after checking they really are copies, so an untied checkpoint is not silently mis-loaded).
- Older checkpoints carry the buffers `bert.embeddings.position_ids` / `token_type_ids` (dropped) and
  TF-style LayerNorm names `gamma`/`beta` (renamed to `weight`/`bias`, as transformers does on load).
No transformers import here: the functions work on numpy arrays and plain dicts.
"""
import os
import shutil
from typing import Any, Dict, Optional

import numpy as np

from base.errors import UserError

ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM")  # config.json architectures this adapter imports
WORD_EMBEDDING = "bert.embeddings.word_embeddings.weight"
MLM_BIAS = "cls.predictions.bias"
TIED_ALIASES = {"cls.predictions.decoder.weight": WORD_EMBEDDING, "cls.predictions.decoder.bias": MLM_BIAS}
BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


def to_hf(params: Dict[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """mindlab parameters -> a `BertForPreTraining` state dict (with the tied decoder aliases)."""
    sd = dict(params)
    for alias, source in TIED_ALIASES.items():
        if source in params:  # (an adapter-only dict has no embedding to alias)
            sd[alias] = params[source]
    return sd


def _rename_tf_layernorm(name: str) -> str:
    if ".LayerNorm." in name:
        if name.endswith(".gamma"):
            return name[: -len("gamma")] + "weight"
        if name.endswith(".beta"):
            return name[: -len("beta")] + "bias"
    return name


def from_hf(sd: Dict[str, Any], hf: Dict[str, Any]) -> Dict[str, np.ndarray]:
    """A `BertForPreTraining` state dict -> mindlab parameters (aliases and buffers dropped); `hf` is its
    config.json (BERT's names do not depend on it)."""
    out = {_rename_tf_layernorm(k): np.asarray(v) for k, v in sd.items() if k not in BUFFERS}
    for alias, source in TIED_ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if source in out and not np.array_equal(value, out[source]):
                raise ValueError(f"{alias} differs from {source}: mindlab's BERT ties the MLM decoder to it")
            out.setdefault(source, value)
    return out


def hf_config(cfg: Any) -> Dict[str, Any]:
    """Our BertConfig (dataclass or OmegaConf node) -> kwargs of `transformers.BertConfig`."""
    return {
        "vocab_size": int(cfg.vocab_size),
        "hidden_size": int(cfg.hidden_size),
        "num_hidden_layers": int(cfg.num_layers),
        "num_attention_heads": int(cfg.num_heads),
        "intermediate_size": int(cfg.intermediate_size),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "type_vocab_size": int(cfg.type_vocab_size),
        "layer_norm_eps": float(cfg.layer_norm_eps),
        "hidden_act": str(cfg.hidden_act),
        "hidden_dropout_prob": float(cfg.hidden_dropout),
        "attention_probs_dropout_prob": float(cfg.attention_dropout),
        "initializer_range": float(cfg.init_std),
        "pad_token_id": int(cfg.pad_token_id),
        "architectures": ["BertForPreTraining"],
        "model_type": "bert",
    }


def config_from_hf(hf: Dict[str, Any], where: str) -> Dict[str, Any]:
    """A Hugging Face BERT config dict (config.json at `where`) -> our BertConfig field values (`name` is left
    to the caller). Missing keys take transformers' BertConfig defaults. Only absolute position embeddings."""
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise UserError(f"{where}: position_embedding_type {hf['position_embedding_type']!r} is not supported; "
                        "mindlab imports absolute position embeddings only")
    return {
        "family": "bert",
        "vocab_size": hf.get("vocab_size", 30522),
        "hidden_size": hf.get("hidden_size", 768),
        "num_layers": hf.get("num_hidden_layers", 12),
        "num_heads": hf.get("num_attention_heads", 12),
        "intermediate_size": hf.get("intermediate_size", 3072),
        "max_position_embeddings": hf.get("max_position_embeddings", 512),
        "type_vocab_size": hf.get("type_vocab_size", 2),
        "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
        "hidden_act": hf.get("hidden_act", "gelu"),
        "hidden_dropout": hf.get("hidden_dropout_prob", 0.1),
        "attention_dropout": hf.get("attention_probs_dropout_prob", 0.1),
        "init_std": hf.get("initializer_range", 0.02),
        "pad_token_id": hf.get("pad_token_id", 0),
    }


def save_tokenizer(tokenizer_file: str, out_dir: str, chat_template: Optional[str] = None) -> None:
    """The sentencepiece model as is: transformers' BERT tokenizers are WordPiece, which it is not. Load it with
    sentencepiece (or mindlab's data.tokenizer.Tokenizer); [CLS] [SEP] [MASK] are whole pieces 4, 5, 6. An
    encoder is not prompted: `chat_template` is not written."""
    shutil.copy(tokenizer_file, os.path.join(out_dir, "tokenizer.model"))
