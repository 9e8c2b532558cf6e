"""The causal-LM interface: what the objectives and evaluation use of a decoder, whatever its family, instead of
its attribute paths. A family whose `CAUSAL` is true builds a CausalLM:

    model(tokens, positions=None, segments=None)      -> fp32 logits [B, S, vocab]
    model.model                                       the trunk (the `model.*` parameters): model.model(tokens,
                                                      positions=None, segments=None) -> final hidden states
                                                      [B, S, hidden]; a reward model keeps it and drops the head
    model.head(hidden)                                -> fp32 logits
    model.hidden_size                                 the hidden states' width (a reward or value head's)
    model.HAS_AUX                                     whether training adds an auxiliary loss (a router's)
    model.model.with_aux(tokens, positions, segments) -> (hidden, auxiliary loss: fp32 scalar, its coefficients
                                                      applied); asked only where HAS_AUX
    model.logits_and_aux(tokens, positions, segments) -> (logits, auxiliary loss)

A loss cell adds the auxiliary loss where its `has_aux` (the model's `HAS_AUX`, a Python constant, so a dense model's
graph has no trace of it) is true: objectives/clm.py, sft.py, dpo.py, rm.py and ppo.py do, so training optimises
it. Validation builds the same cell with `has_aux` false (evaluation/validation.py lm_loss_only): it runs the
plain forward `model(...)` and reports the objective's loss alone. What the model reports besides (a router's
load, its dropped tokens, its losses before their coefficients) is the family's `step_metrics` (base/family.py),
recorded by the training forward `with_aux` only.
"""
import numpy as np

import mindspore as ms
from mindspore import nn, ops

from models.common.layers import DTYPES, Linear


class CausalLM(nn.Cell):
    """Base of a family's causal LM: `model` (the trunk) and `hidden_size` are the family's, `head` too unless it is
    the usual LM head (an `lm_head` Linear, or the tied embedding)."""

    HAS_AUX = False

    def assemble(self, cfg, trunk, compute_dtype: str, flash: bool, seed: int, deferred: bool = False) -> None:
        """The trunk `model` (trunk(cfg, rng, dtype, flash)) then the head (an `lm_head` Linear, or with
        cfg.tie_embeddings `head_matmul` over the trunk's embedding), from one numpy stream: identical weights on
        every rank, independent of the backend. `deferred` (a sharded build): the weights are initialised by the
        sharded compile, each rank its slices (models/common/layers.py _init)."""
        self.hidden_size = cfg.hidden_size
        rng = None if deferred else np.random.default_rng(seed)
        dtype = DTYPES[compute_dtype]
        self.model = trunk(cfg, rng, dtype, flash)
        self.tie_embeddings = cfg.tie_embeddings
        if not cfg.tie_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.init_std, rng, dtype)
        else:
            self.head_matmul = ops.MatMul(transpose_b=True)
        self.compute_dtype = dtype

    def layers(self):
        return self.model.layers

    def construct(self, tokens, positions=None, segments=None):
        return self.head(self.model(tokens, positions, segments))

    def logits_and_aux(self, tokens, positions=None, segments=None):
        hidden, aux = self.model.with_aux(tokens, positions, segments)
        return self.head(hidden), aux

    def head(self, h):
        """Final hidden states [..., hidden] -> fp32 logits [..., vocab] (the LM head, or the tied embedding): a
        family's `lm_head` Linear, or with `tie_embeddings` its trunk's `tok_embeddings` through `head_matmul`."""
        if self.tie_embeddings:
            w = self.model.tok_embeddings.embedding_weight.astype(self.compute_dtype)
            logits = self.head_matmul(h.reshape(-1, h.shape[-1]).astype(self.compute_dtype), w)
            logits = logits.reshape(h.shape[:-1] + (-1,))
        else:
            logits = self.lm_head(h)
        return logits.astype(ms.float32)

