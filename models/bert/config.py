"""The BERT model config: a plain dataclass (no MindSpore import), used by the config schema.

Defaults follow BERT-base conventions (Devlin et al. 2019; Hugging Face `BertConfig`); the shape fields
have no default and must come from a preset.
"""
from dataclasses import dataclass

from omegaconf import MISSING

from base.family import FamilyConfig


@dataclass
class BertConfig(FamilyConfig):
    family: str = "bert"  # model family tag: selects models/bert/ when building the model
    intermediate_size: int = MISSING  # width of the GELU MLP in each encoder layer (4h in BERT-base)
    max_position_embeddings: int = 512  # rows of the learned absolute position embedding (max sequence length)
    type_vocab_size: int = 2  # token-type (segment A/B) embedding rows
    layer_norm_eps: float = 1e-12  # epsilon of every LayerNorm
    hidden_act: str = "gelu"  # MLP / MLM-transform activation; "gelu" is the exact erf GELU (Hugging Face "gelu")
    hidden_dropout: float = 0.1  # dropout on embeddings and on each sublayer output before the residual add
    attention_dropout: float = 0.1  # dropout on the attention probabilities
    init_std: float = 0.02  # std of the normal init of embeddings and linear weights (HF initializer_range)
    pad_token_id: int = 0  # id of [PAD] (Hugging Face pad_token_id / word-embedding padding_idx)
