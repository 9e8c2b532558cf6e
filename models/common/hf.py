"""What decoder families share of their Hugging Face adapters: the names of the models/common/ blocks (embedding,
attention, norms, head: MindFormers' Llama names on the left, Hugging Face's on the right; Llama, Mixtral and
Qwen2-MoE name them alike), the renaming rule, the special token ids and the sentencepiece tokenizer export.
"""
import re
from typing import Dict, Optional

# special token ids of data/tokenizer.py's sentencepiece models
PAD_ID, BOS_ID, EOS_ID = 0, 2, 3  # unk is 1

DECODER_NAMES = {  # mindlab / MindFormers -> Hugging Face; {i} is the layer index
    "model.tok_embeddings.embedding_weight": "model.embed_tokens.weight",
    "model.layers.{i}.attention.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "model.layers.{i}.attention.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "model.layers.{i}.attention.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "model.layers.{i}.attention.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "model.layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "model.layers.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "model.norm_out.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "score.weight": "score.weight",  # a reward model's scalar head (objectives/rm.py)
}


def _rename(name: str, table: Dict[str, str]) -> str:
    for source, target in table.items():
        match = re.fullmatch(re.escape(source).replace(r"\{i\}", r"(?P<i>\d+)"), name)
        if match:
            return target.format(**match.groupdict())
    raise ValueError(f"no conversion rule for parameter {name!r}")


def save_tokenizer(tokenizer_file: str, out_dir: str, chat_template: Optional[str] = None) -> None:
    """The sentencepiece model as a Hugging Face LlamaTokenizer (tokenizer.model + its config files), with the
    training template as its chat template (`apply_chat_template` then renders what SFT trained on)."""
    from transformers import LlamaTokenizer

    tokenizer = LlamaTokenizer(vocab_file=tokenizer_file, add_bos_token=False, add_eos_token=False, legacy=False,
                               pad_token="<pad>")
    tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(out_dir)
