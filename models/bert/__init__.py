"""The BERT family: a bidirectional post-LayerNorm encoder with MLM and NSP heads (Devlin et al. 2019), native
MindSpore (MindFormers 1.9 ships no BERT).

    config.py      BertConfig, the typed `model` group       model.py   BertForPreTraining
    accounting.py  parameters and FLOPs from the config       hf.py      Hugging Face BertForPreTraining adapter

Importing this package is cheap (no MindSpore): the config schema and the dry run use it. BERT has no
tensor/pipeline plan yet (no plan.py): validation refuses tp/pp for it.
"""
from base.errors import require
from models.bert import hf
from models.bert.accounting import flops_per_token, layer_activation_factors, matmul_parameter_count, \
    parameter_count, stage_parameters
from models.bert.config import BertConfig as Config

__all__ = ["Config", "build", "check", "describe", "flops_per_token", "hf", "layer_activation_factors",
           "matmul_parameter_count", "parameter_count", "stage_parameters"]
CAUSAL = False  # bidirectional: a causal objective would let each position see its target


def build(cfg: Config, seq_len: int, compute_dtype: str, use_flash: bool, seed: int, sharded: bool = False):
    """(input_ids, token_type_ids, attention_mask) [B, S] -> (MLM logits [B, S, vocab], NSP logits [B, 2]), fp32.
    `sharded` (optimizer sharding): weights initialised by the sharded compile, each rank its slices."""
    from models.bert.model import BertForPreTraining

    return BertForPreTraining(cfg, compute_dtype, seed, deferred=sharded)


def recompute_cells(model, mode: str) -> list:
    """full: each encoder layer; selective: only the attention core (scores/softmax/probs @ v)."""
    return [layer if mode == "full" else layer.attention.self.core for layer in model.layers()]


def attention_kind(cfg: Config, device, compute_dtype: str, sharded: bool) -> str:
    """Always plain: BERT attends under a padding mask, which flash attention is not used for here (check())."""
    return "plain"


def check(cfg) -> None:
    """Rules of this family's keys (base/validate.py calls it; each failure names the key)."""
    m, p = cfg.model, cfg.parallel
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size", "type_vocab_size"):
        require(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
    require(m.hidden_size % m.num_heads == 0, "model.num_heads",
            f"hidden_size={m.hidden_size} is not divisible by num_heads={m.num_heads}")
    require(m.hidden_act in ("gelu", "gelu_new", "relu"), "model.hidden_act",
            f"got {m.hidden_act!r}; choose one of gelu, gelu_new, relu")
    for key in ("hidden_dropout", "attention_dropout"):
        require(0 <= m[key] < 1, f"model.{key}", f"must be in [0, 1), got {m[key]}")
    require(not m.flash_attention, "model.flash_attention", "the BERT family uses plain attention (padding mask); "
            "set model.flash_attention=null")
    require(p.tp == 1 and p.pp == 1, "parallel", f"parallel={p.name}: the BERT family has no tensor/pipeline plan; "
            "use data parallelism (parallel=dp2) or the Llama family")


def describe(m, count) -> list:
    """Dry-run lines: the shape and where the parameters are (`count` formats a number)."""
    c = parameter_count(m)
    return [f"  vocab {m.vocab_size}, hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads "
            f"(head dim {m.hidden_size // m.num_heads}), ffn {m.intermediate_size}, positions "
            f"{m.max_position_embeddings}, token types {m.type_vocab_size}"] + \
        [f"  {name:<11} {count(n)}" for name, n in c.items() if name != "total"]
