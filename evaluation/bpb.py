"""Bits per byte: the NLL of target tokens over the UTF-8 bytes of the text they spell, comparable across
tokenizers. A token's bytes come from its sentencepiece piece (`piece_bytes`): '▁' is one byte (a space),
byte-fallback pieces <0xNN> one byte, pad/unk/bos/eos none, other pieces their UTF-8 length; the dummy-prefix
'▁' sentencepiece puts before each document's first piece is not text and is not counted (`target_bytes`).

The unigram baseline (`unigram_nll`): add-one smoothed token frequencies of the training split, scored on the
same targets.
"""
import math
from typing import Dict, List, Optional

import numpy as np

LN2 = math.log(2.0)


def piece_bytes(tokenizer) -> np.ndarray:
    """int64 [vocab]: UTF-8 bytes of each piece's text. '▁' is a space (one byte), a byte-fallback piece <0xNN>
    one byte, control / unknown / unused pieces (pad, unk, bos, eos) none, others their UTF-8 length."""
    sp = tokenizer.sp
    out = np.zeros(sp.get_piece_size(), np.int64)
    for i in range(len(out)):
        if sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i):
            continue
        out[i] = 1 if sp.is_byte(i) else len(sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8"))
    return out


def dummy_prefix_pieces(tokenizer) -> Optional[np.ndarray]:
    """bool [vocab]: pieces starting with '▁', when the tokenizer adds a dummy '▁' before each text it encodes
    (sentencepiece's add_dummy_prefix); None when it does not. Told by encoding "x", whose first piece then starts
    with '▁': reading the flag from the model's proto took 0.2 s at 8192 pieces, 0.5 s at 32000 on the way to
    every run's first step (protobuf's pure-Python parser, which importing MindSpore selects)."""
    sp = tokenizer.sp
    if not sp.encode("x", out_type=str)[0].startswith("\u2581"):
        return None
    return np.array([not (sp.is_control(i) or sp.is_unknown(i) or sp.is_unused(i) or sp.is_byte(i))
                     and sp.id_to_piece(i).startswith("\u2581") for i in range(sp.get_piece_size())])


def target_bytes(input_ids: np.ndarray, table: np.ndarray, eos_id: int = -1,
                 dummy_prefix: Optional[np.ndarray] = None, labels: Optional[np.ndarray] = None) -> np.ndarray:
    """int64 [N, S]: the UTF-8 bytes of each target token input_ids[:, 1:] (`table` = piece_bytes). With
    `dummy_prefix` (dummy_prefix_pieces), a target right after `eos_id` starts a document, and the '▁' its piece
    starts with is sentencepiece's dummy prefix, not a space of the text: one byte less. With `labels` (a causal
    objective's, negative where a token carries no loss, e.g. SFT's prompts), the targets are labels[:, 1:] and
    those without loss count no bytes."""
    ids = np.asarray(input_ids, np.int64)
    targets = ids[:, 1:] if labels is None else np.asarray(labels, np.int64)[:, 1:]
    counted = targets >= 0
    targets = np.where(counted, targets, 0)
    out = table[targets]
    if dummy_prefix is not None:
        out = out - ((ids[:, :-1] == eos_id) & dummy_prefix[targets])
    return out * counted


def bits_per_byte(nll_nats: float, n_bytes: int) -> float:
    """Total NLL in nats -> bits per UTF-8 byte of the text it scored."""
    return float(nll_nats) / LN2 / n_bytes if n_bytes else float("nan")


def unigram_nll(train_tokens: np.ndarray, targets: np.ndarray, vocab_size: int) -> np.ndarray:
    """NLL (nats) of each of `targets` under the add-one smoothed unigram distribution of `train_tokens`."""
    counts = np.bincount(np.asarray(train_tokens, np.int64).ravel(), minlength=vocab_size).astype(np.float64)
    logp = np.log(counts + 1.0) - np.log(counts.sum() + vocab_size)
    return -logp[np.asarray(targets, np.int64)]


def val_target_bytes(objective, val: Dict[str, List[tuple]], tokenizer) -> Optional[Dict[str, int]]:
    """Per source, the UTF-8 bytes of the loss targets of the validation inputs (input_ids, labels, ...): what
    turns the validation loss into bits per byte. None unless the objective's loss is a per-token NLL (its
    `token_nll` hook) and there are validation inputs."""
    if not (val and objective.token_nll is not None):
        return None
    table, prefix = piece_bytes(tokenizer), dummy_prefix_pieces(tokenizer)
    return {source: int(sum(target_bytes(inputs[0], table, tokenizer.eos_id, prefix, inputs[1]).sum()
                            for inputs in batches)) for source, batches in val.items()}
