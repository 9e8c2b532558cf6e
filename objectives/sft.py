"""Supervised fine-tuning on instruction samples: next-token loss on the responses only.

Rows (`sft_rows`, from stage 1's samples: data/samples.py): with packing, whole samples are placed into rows of
seq_len + 1 tokens (best fit, in order of decreasing length), never split across rows; attention stays inside
each sample through `segment_ids` (0 on padding) and `position_ids` restarting at 0 per sample. Without
packing, one sample per row. `labels` holds the token where it carries loss (every response token and the eos
after it) and IGNORE_INDEX elsewhere: the prompt, the template, every sample's first token (nothing before it
in the sample predicts it) and the padding; a pad token is never a target (unlike MindFormers'
PackingHandler, which labels the pad at sample boundaries). The loss is the mean over response
tokens (the step weights micro-batches by them, so the global batch's mean is exact). Logged besides the
loss: `mean_token_accuracy` (argmax = target, over response tokens) and, per step, `loss_tokens`.
"""
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import numpy as np

import mindspore as ms
from mindspore import nn
from omegaconf import MISSING

from base.errors import require
from base.objective import ObjectiveBase
from data.errors import DataError
from data.formats import kinds
from data.rows import RowSpec, Split, best_fit
from objectives import check_fine_tuning
from objectives._cross_entropy import WeightedCrossEntropy, masked_mean_nll
from objectives.clm import TokenNLL

IGNORE_INDEX = -100  # the label of a token without loss (the preference pairs' rows use it too)


@dataclass
class Config:
    name: str = MISSING  # sft
    packing: bool = True  # several whole samples per row, attention kept inside each; false: one per row, padded
    truncate: bool = False  # cut samples longer than data.seq_len + 1 instead of refusing them


def check(cfg) -> None:
    check_fine_tuning(cfg, "sft", kinds(pairs=False), "use data=instructions or your own alpaca/chat JSONL")
    require(not (cfg.objective.packing and cfg.model.flash_attention), "model.flash_attention",
            "packed samples need the segment mask of plain attention (the flash kernel's actual_seq_len path is not "
            "wired); set model.flash_attention=false, or objective.packing=false")


def row_spec(cfg: Config) -> RowSpec:
    return RowSpec(name=f"sft-{'packed' if cfg.packing else 'padded'}{'-truncated' if cfg.truncate else ''}",
                   columns=("input_ids", "labels", "position_ids", "segment_ids"), schema=sft_schema,
                   build=partial(sft_rows, cfg.packing, cfg.truncate))


def sft_schema(seq_len: int) -> dict:
    return {name: {"type": "int32", "shape": [seq_len + 1]}
            for name in ("input_ids", "labels", "position_ids", "segment_ids")}


def sft_rows(packing: bool, truncate: bool, split: Split, seq_len: int, tokenizer) -> Iterator[dict]:
    """The rows of one split (see the module docstring); prints how full the rows are."""
    if split.loss_mask is None or split.margin is not None:
        raise DataError(f"{split.where}: holds {'documents' if split.loss_mask is None else 'preference pairs'}, not "
                        f"instruction samples; objective=sft trains on sources of kind {', '.join(kinds(pairs=False))}")
    size = seq_len + 1
    spans = [(int(a), int(b)) for a, b in zip(split.offsets[:-1], split.offsets[1:])]
    for i, (a, b) in enumerate(spans):
        if b - a > size and not truncate:
            raise DataError(f"{split.where}: sample {i + 1} has {b - a} tokens, more than data.seq_len + 1 = {size}; "
                            f"raise data.seq_len, or set objective.truncate=true to cut such samples")
    spans = [(a, min(b, a + size)) for a, b in spans]
    rows = [[spans[i] for i in row] for row in best_fit([b - a for a, b in spans], size)] if packing \
        else [[span] for span in spans]
    used = sum(b - a for a, b in spans)
    print(f"[data] {split.where}: {len(spans):,} samples in {len(rows):,} rows of {size} tokens, "
          f"{used / max(len(rows) * size, 1):.1%} of row tokens are sample tokens"
          + (" (packed)" if packing else " (one sample per row)"), flush=True)
    tokens, mask = np.asarray(split.tokens), np.asarray(split.loss_mask)
    for row in rows:
        out = {"input_ids": np.full(size, tokenizer.pad_id, np.int32),
               "labels": np.full(size, IGNORE_INDEX, np.int32),
               "position_ids": np.zeros(size, np.int32), "segment_ids": np.zeros(size, np.int32)}
        at = 0
        for segment, (a, b) in enumerate(row, 1):
            n = b - a
            ids = tokens[a:b].astype(np.int32)
            out["input_ids"][at:at + n] = ids
            labels = np.where(mask[a:b] > 0, ids, IGNORE_INDEX)
            labels[0] = IGNORE_INDEX  # nothing in the sample precedes its first token
            out["labels"][at:at + n] = labels
            out["position_ids"][at:at + n] = np.arange(n)
            out["segment_ids"][at:at + n] = segment
            at += n
        yield out


class Objective(ObjectiveBase):
    inputs = ("input_ids", "labels", "position_ids", "segment_ids")
    metrics = ("mean_token_accuracy",)
    console = ("mean_token_accuracy",)

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg = cfg

    def batch(self, rows: dict, sample: int) -> tuple:
        return rows["input_ids"], rows["labels"], rows["position_ids"], rows["segment_ids"]

    def loss_tokens(self, inputs: tuple) -> int:
        return int(np.count_nonzero(inputs[1][:, 1:] != IGNORE_INDEX))

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return ResponseLoss(model)

    def token_nll(self, model: nn.Cell) -> nn.Cell:
        """The loss is the mean NLL of the response tokens: training logs bits per byte from it and the bytes of
        those targets, and scores trainer.eval_tasks with this cell (one text per row; the packed validation rows'
        segments are the loss cell's, which `python -m evaluation` avoids by scoring an SFT checkpoint as a
        language model of documents, objective=clm)."""
        return TokenNLL(model)


class ResponseLoss(nn.Cell):
    """(mean next-token loss over labelled tokens, accuracy over them), fp32."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model, self.has_aux = model, model.HAS_AUX
        self.cross_entropy = WeightedCrossEntropy()

    def construct(self, input_ids, labels, position_ids, segment_ids):
        if self.has_aux:  # a router's auxiliary loss (models/common/causal_lm.py)
            logits, aux = self.model.logits_and_aux(input_ids[:, :-1], position_ids[:, :-1], segment_ids[:, :-1])
        else:
            logits, aux = self.model(input_ids[:, :-1], position_ids[:, :-1], segment_ids[:, :-1]), 0.0
        targets = labels[:, 1:].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1]).astype(ms.float32)
        loss, mask, n = masked_mean_nll(self.cross_entropy, logits, targets, IGNORE_INDEX)
        accuracy = ((logits.argmax(-1) == targets).astype(ms.float32) * mask).sum() / n
        return (loss + aux if self.has_aux else loss), accuracy
