"""Supervised fine-tuning on instruction samples: next-token loss on the responses only.

The rows (data/samples.py) carry `labels` that are -100 on the prompt, the template and the padding, and the
token itself on every response token and on the eos after it; packed rows add `position_ids` and
`segment_ids`, with which the model keeps attention inside each sample. The loss is the mean over response
tokens (the step weights micro-batches by them, so the global batch's mean is exact). Logged besides the
loss: `mean_token_accuracy` (argmax = target, over response tokens) and, per step, `loss_tokens`.
"""
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from mindspore import nn
from omegaconf import MISSING

from base.errors import require
from base.schema import INSTRUCTION_KINDS
from data.samples import IGNORE_INDEX, sft_row_spec
from objectives import check_fine_tuning
from objectives._cross_entropy import WeightedCrossEntropy, masked_mean_nll


@dataclass
class Config:
    name: str = MISSING  # sft
    packing: bool = True  # several whole samples per row, attention kept inside each; false: one per row, padded
    truncate: bool = False  # cut samples longer than data.seq_len + 1 instead of refusing them


def check(cfg) -> None:
    check_fine_tuning(cfg, "sft", INSTRUCTION_KINDS, "use data=instructions or your own alpaca/chat JSONL")
    require(not (cfg.objective.packing and cfg.model.flash_attention), "model.flash_attention",
            "packed samples need the segment mask of plain attention (the flash kernel's actual_seq_len path is not "
            "wired); set model.flash_attention=false, or objective.packing=false")


def row_spec(cfg: Config):
    return sft_row_spec(cfg.packing, cfg.truncate)


class Objective:
    inputs = ("input_ids", "labels", "position_ids", "segment_ids")
    metrics = ("mean_token_accuracy",)
    token_nll = True  # the loss is the mean NLL of labels[:, 1:]: evaluation adds bits per byte

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg = cfg

    def batch(self, rows: dict, sample: int) -> tuple:
        return rows["input_ids"], rows["labels"], rows["position_ids"], rows["segment_ids"]

    def loss_tokens(self, inputs: tuple) -> int:
        return int(np.count_nonzero(inputs[1][:, 1:] != IGNORE_INDEX))

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return ResponseLoss(model)


class ResponseLoss(nn.Cell):
    """(mean next-token loss over labelled tokens, accuracy over them), fp32."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model
        self.cross_entropy = WeightedCrossEntropy()

    def construct(self, input_ids, labels, position_ids, segment_ids):
        logits = self.model(input_ids[:, :-1], position_ids[:, :-1], segment_ids[:, :-1])
        targets = labels[:, 1:].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1]).astype(ms.float32)
        loss, mask, n = masked_mean_nll(self.cross_entropy, logits, targets, IGNORE_INDEX)
        accuracy = ((logits.argmax(-1) == targets).astype(ms.float32) * mask).sum() / n
        return loss, accuracy
