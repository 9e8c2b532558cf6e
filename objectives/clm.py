"""Causal language modelling: predict token t+1 from tokens <= t.

A batch row holds seq_len + 1 tokens; the model reads the first seq_len, the labels are the last seq_len.
Positions whose label equals `ignore_index` (padding, masked prompt tokens) carry no loss. The loss is the
mean over counted positions, computed in fp32 whatever the compute dtype.
"""
import mindspore as ms
from mindspore import nn, ops


class CausalLMLoss(nn.Cell):
    def __init__(self, model: nn.Cell, ignore_index: int = -100):
        super().__init__(auto_prefix=False)  # keep the model's parameter names
        self.model = model
        self.ignore_index = ignore_index

    def construct(self, input_ids, labels):
        logits = self.model(input_ids[:, :-1])
        targets = labels[:, 1:].reshape(-1)
        logits = logits.reshape(-1, logits.shape[-1]).astype(ms.float32)
        mask = (targets != self.ignore_index).astype(ms.float32)
        safe_targets = ops.select(targets != self.ignore_index, targets, ops.zeros_like(targets))
        logp = ops.log_softmax(logits, -1)
        nll = -ops.gather_elements(logp, 1, safe_targets.reshape(-1, 1)).reshape(-1)
        return (nll * mask).sum() / ops.maximum(mask.sum(), 1.0)
