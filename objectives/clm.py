"""Causal language modelling: predict token t+1 from tokens <= t.

A batch row holds seq_len + 1 tokens (data/packing.py's PACKED rows); the model reads the first seq_len, the
labels are the last seq_len. Positions whose label equals `ignore_index` (padding, masked prompt tokens)
carry no loss. The loss is the mean over counted positions, computed in fp32 whatever the compute dtype.

Evaluation's hook, `Objective.token_nll(model)`: the TokenNLL cell, the NLL of every target token, whose mean
over the counted targets is this loss. With it evaluation reports bits per byte, loss by position, and scores
tasks and passkey retrieval by log-likelihood (evaluation/); any objective exposing the same hook gets them.
"""
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from mindspore import nn, ops
from omegaconf import MISSING

from base.errors import require
from base.objective import ObjectiveBase
from data.packing import DOCUMENT_PACKED, PACKED
from objectives._cross_entropy import WeightedCrossEntropy, masked_mean_nll


@dataclass
class Config:
    name: str = MISSING  # clm
    ignore_index: int = -100  # labels with this value carry no loss
    # stream: documents back to back, cut every seq_len tokens (data/packing.py PACKED); documents: rows
    # reordered so no document that fits in a row is split (DOCUMENT_PACKED; stage=long_context sets it)
    packing: str = "stream"


def check(cfg) -> None:
    from models import family

    require(family(cfg.model.family).CAUSAL, "objective", f"clm trains a causal decoder; model.family="
            f"{cfg.model.family} attends both ways, so it would see the token it predicts (use objective=mlm)")
    require(cfg.objective.packing in ("stream", "documents"), "objective.packing",
            f"got {cfg.objective.packing!r}; choose one of stream, documents")


def row_spec(cfg: Config):
    return DOCUMENT_PACKED if cfg.packing == "documents" else PACKED


class Objective(ObjectiveBase):
    inputs = ("input_ids", "labels")
    metrics = ()
    console = ()  # the loss, its perplexity and bits per byte say it all

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.ignore_index = cfg.ignore_index

    def batch(self, rows: dict, sample: int) -> tuple:
        return rows["input_ids"], rows["input_ids"]

    def loss_tokens(self, inputs: tuple) -> int:
        return int(np.count_nonzero(inputs[1][:, 1:] != self.ignore_index))

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return CausalLMLoss(model, self.ignore_index)

    def token_nll(self, model: nn.Cell) -> nn.Cell:
        return TokenNLL(model)


class CausalLMLoss(nn.Cell):
    def __init__(self, model: nn.Cell, ignore_index: int = -100):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model, self.has_aux = model, model.HAS_AUX
        self.ignore_index = ignore_index
        self.cross_entropy = WeightedCrossEntropy()

    def construct(self, input_ids, labels):
        if self.has_aux:  # a router's auxiliary loss (models/common/causal_lm.py)
            logits, aux = self.model.logits_and_aux(input_ids[:, :-1])
        else:
            logits, aux = self.model(input_ids[:, :-1]), 0.0
        targets = labels[:, 1:].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1]).astype(ms.float32)
        loss = masked_mean_nll(self.cross_entropy, logits, targets, self.ignore_index)[0]
        return (loss + aux,) if self.has_aux else (loss,)


class TokenNLL(nn.Cell):
    """input_ids int32 [B, S + 1] (rows of a causal LM) -> (fp32 [B, S]: the NLL (nats) of each target
    input_ids[:, j + 1] given input_ids[:, :j + 1], whose mean over the counted targets is CausalLMLoss; bool
    [B, S]: the target is the most likely token, lm-eval's `is_greedy`)."""

    def __init__(self, model: nn.Cell):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model

    def construct(self, input_ids):
        logits = self.model(input_ids[:, :-1]).astype(ms.float32)
        logp = ops.log_softmax(logits, -1)
        targets = input_ids[:, 1:]
        nll = -ops.gather_elements(logp, 2, targets.expand_dims(-1)).squeeze(-1)
        return nll, ops.argmax(logits, -1).astype(targets.dtype) == targets
