"""Direct Preference Optimization (Rafailov et al. 2023) and its IPO / hinge variants: the policy learns from
preference pairs against a frozen reference, with no reward model and no sampling.

For a pair, with log-probabilities summed over the response tokens (the response, the template's end text
and the eos: what SFT puts loss on),

    h = (log pi(chosen) - log pi(rejected)) - (log ref(chosen) - log ref(rejected))
    sigmoid  -(1 - ls) log sigmoid(beta h) - ls log sigmoid(-beta h)    DPO; ls = label_smoothing (cDPO)
    ipo      (h - 1 / (2 beta))^2, with log-probabilities averaged over the response tokens (Azar et al.
             2023; as TRL)
    hinge    max(0, 1 - beta h)                                         (SLiC, Zhao et al. 2023)

mean over pairs (the step normalizes by pairs across micro-batches and replicas), plus `nll_coefficient`
times the mean next-token loss on the chosen responses (RPO, Pang et al. 2024; TRL's `rpo_alpha`).

The reference (`objective.reference`, objectives/_reference.py): `copy`, a frozen copy of the starting
weights, or with peft=lora `lora_base`, the policy's own frozen base without the adapters (no second copy in
memory). Either runs inside the step's graph under stop_gradient.

Logged with TRL's names: `rewards/chosen` and `rewards/rejected` (beta times the policy/reference log-ratio
of each side; per-token means under ipo, as TRL), `rewards/accuracies` (chosen's above rejected's),
`rewards/margins`, `logps/chosen`,
`logps/rejected` (the policy's, summed), and `kl`: the mean over response tokens of the exact next-token
KL(pi || ref) at the data's positions (on both sides).

    python train.py stage=dpo stage.init_from=runs/sft/checkpoints/latest data=preferences objective.beta=0.1
"""
from dataclasses import dataclass

import mindspore as ms
from mindspore import nn, ops
from omegaconf import MISSING

from conf.errors import require
from conf.schema import PREFERENCE_KINDS
from data.preferences import DATA_HINT, pair_row_spec
from data.samples import IGNORE_INDEX
from objectives import _reference, check_fine_tuning

LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass
class Config:
    name: str = MISSING  # dpo
    beta: float = 0.1  # strength of the KL leash to the reference (higher: stay closer)
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge
    label_smoothing: float = 0.0  # sigmoid only: the probability that a pair's label is flipped (cDPO)
    nll_coefficient: float = 0.0  # weight of the chosen responses' next-token loss (RPO); 0: off
    reference: str = "copy"  # copy | lora_base (peft=lora: the frozen base, shared)
    skip_long: bool = False  # leave out pairs with a side longer than data.seq_len instead of refusing them


def check(cfg) -> None:
    o = cfg.objective
    check_fine_tuning(cfg, "dpo", PREFERENCE_KINDS, DATA_HINT)
    require(o.beta > 0, "objective.beta", f"must be > 0, got {o.beta}")
    require(o.loss in LOSSES, "objective.loss", f"got {o.loss!r}; choose one of {', '.join(LOSSES)}")
    require(0 <= o.label_smoothing < 0.5, "objective.label_smoothing", f"must be in [0, 0.5), got {o.label_smoothing}")
    require(o.label_smoothing == 0 or o.loss == "sigmoid", "objective.label_smoothing",
            f"applies to loss=sigmoid only, not {o.loss}; set it to 0")
    require(o.nll_coefficient >= 0, "objective.nll_coefficient", f"must be >= 0, got {o.nll_coefficient}")
    _reference.check(cfg, "objective.reference")


def row_spec(cfg: Config):
    return pair_row_spec(cfg.skip_long)


def memory(cfg):
    """For the dry-run planner: a pair is two sequences, whose fp32 log-probabilities over the vocabulary the
    step keeps for the policy and, for the KL term's backward, for a reference run in the graph."""
    from planner.memory import ObjectiveMemory

    in_graph = cfg.objective.reference in ("copy", "lora_base")
    return ObjectiveMemory(sequences=2, logits=2 if in_graph else 1, extra=_reference.memory_rows(cfg))


class Objective:
    inputs = ("chosen_ids", "chosen_labels", "rejected_ids", "rejected_labels")
    metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "kl")

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg, self.reference = cfg, None

    def batch(self, rows: dict, sample: int) -> tuple:
        return rows["chosen_ids"], rows["chosen_labels"], rows["rejected_ids"], rows["rejected_labels"]

    def loss_tokens(self, inputs: tuple) -> int:
        return len(inputs[0])  # pairs

    def attach(self, model: nn.Cell, cfg) -> nn.Cell:
        """Builds the frozen reference from `model` as it is now (the starting weights) and returns `model`."""
        self.reference = _reference.build_reference(model, cfg, self.cfg.reference)
        return model

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        if self.reference is None:
            raise RuntimeError("objective=dpo: attach(model, cfg) builds the reference before loss_cell")
        return PreferenceLoss(model, self.reference, self.cfg)


class PreferenceLoss(nn.Cell):
    def __init__(self, policy: nn.Cell, reference: nn.Cell, cfg: Config):
        super().__init__(auto_prefix=False)
        self.policy, self.reference = policy, reference
        self.beta, self.kind, self.ls, self.nll = cfg.beta, cfg.loss, cfg.label_smoothing, cfg.nll_coefficient

    def construct(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels):
        ids = ops.cat((chosen_ids, rejected_ids))[:, :-1]
        targets = ops.cat((chosen_labels, rejected_labels))[:, 1:]
        counted = targets != IGNORE_INDEX
        mask = counted.astype(ms.float32)
        safe = ops.select(counted, targets, ops.zeros_like(targets))
        token_logps, logp = _reference.token_logps(self.policy(ids), safe)  # [2B, S], [2B, S, vocab]
        ref_token_logps, ref_logp = _reference.token_logps(self.reference(ids), safe)
        ref_token_logps, ref_logp = ops.stop_gradient(ref_token_logps), ops.stop_gradient(ref_logp)
        token_logps, ref_token_logps = token_logps * mask, ref_token_logps * mask
        lengths = ops.maximum(mask.sum(1), 1.0)
        logps, ref_logps = token_logps.sum(1), ref_token_logps.sum(1)
        if self.kind == "ipo":
            logps, ref_logps = logps / lengths, ref_logps / lengths
        pi_c, pi_r = ops.split(logps, chosen_ids.shape[0])
        ref_c, ref_r = ops.split(ref_logps, chosen_ids.shape[0])
        h = (pi_c - pi_r) - (ref_c - ref_r)
        if self.kind == "sigmoid":
            losses = (1 - self.ls) * ops.softplus(-self.beta * h) + self.ls * ops.softplus(self.beta * h)
        elif self.kind == "ipo":
            losses = (h - 1 / (2 * self.beta)) ** 2
        else:
            losses = ops.relu(1 - self.beta * h)
        loss = losses.mean()
        if self.nll > 0:
            n = chosen_ids.shape[0]
            loss = loss - self.nll * token_logps[:n].sum() / ops.maximum(mask[:n].sum(), 1.0)
        reward_c, reward_r = self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r)
        kl = ((ops.exp(logp) * (logp - ref_logp)).sum(-1) * mask).sum() / ops.maximum(mask.sum(), 1.0)
        sums = ops.split(token_logps.sum(1), chosen_ids.shape[0])
        return (loss, reward_c.mean(), reward_r.mean(), (reward_c > reward_r).astype(ms.float32).mean(),
                (reward_c - reward_r).mean(), sums[0].mean(), sums[1].mean(), kl)
