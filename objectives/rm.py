"""Reward model (seed 004's second RLHF step): a scalar score per response, trained on preference pairs.

The model is the decoder's trunk with a linear head on the final hidden state of the last real token (the
eos that closes the response), Hugging Face's `LlamaForSequenceClassification` with one label: the LM head
is dropped, `score.weight` [1, hidden] is drawn from N(0, 1/(hidden + 1)) (Stiennon et al. 2020's init, so
rewards start near 0 with unit-scale spread). The loss is Bradley-Terry's

    -log sigmoid(r_chosen - r_rejected - margin)          mean over pairs

with the pair's margin from the data (Llama 2's margin loss; 0 unless the data says), plus, with
`center_coefficient` c > 0, c * mean((r_chosen + r_rejected)^2), which keeps rewards centred on 0 (TRL's
`center_rewards_coefficient`, Eisenstein et al. 2023). The step normalizes by pairs: every pair weighs the
same across micro-batches and replicas.

Logged: `accuracy` (r_chosen > r_rejected), `margin` (mean r_chosen - r_rejected), `mean_reward` (over both
sides), `reward_sq` (mean square, so val_reward_sq - val_mean_reward^2 is the variance over the val set
that PPO normalizes scores with), and `min_reward` / `max_reward` (each micro-batch's, averaged).

    python train.py stage=rm stage.init_from=runs/sft/checkpoints/latest data=preferences model=small
"""
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from omegaconf import MISSING

from conf.errors import require
from conf.schema import PREFERENCE_KINDS
from data.preferences import DATA_HINT, last_labelled, pair_row_spec
from objectives import check_fine_tuning


@dataclass
class Config:
    name: str = MISSING  # rm
    center_coefficient: float = 0.0  # c * mean((r_c + r_r)^2) added to the loss; 0.01 in TRL's docs
    skip_long: bool = False  # leave out pairs with a side longer than data.seq_len instead of refusing them


def check(cfg) -> None:
    check_fine_tuning(cfg, "rm", PREFERENCE_KINDS, DATA_HINT)
    require(cfg.objective.center_coefficient >= 0, "objective.center_coefficient",
            f"must be >= 0, got {cfg.objective.center_coefficient}")


def row_spec(cfg: Config):
    return pair_row_spec(cfg.skip_long)


def memory(cfg):
    """For the dry-run planner: a pair is two sequences; the model has a score row instead of the LM head, so
    no logits."""
    from models import family
    from planner.memory import ObjectiveMemory

    lm_head = family(cfg.model.family).parameter_count(cfg.model)["lm_head"]
    return ObjectiveMemory(sequences=2, logits=0, params_delta=cfg.model.hidden_size - lm_head)


class Objective:
    inputs = ("chosen_ids", "chosen_end", "rejected_ids", "rejected_end", "margin")
    metrics = ("accuracy", "margin", "mean_reward", "reward_sq", "min_reward", "max_reward")

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg, self.seed = cfg, seed

    def batch(self, rows: dict, sample: int) -> tuple:
        """Rows hold seq_len + 1 columns, the last always padding: the model reads the first seq_len."""
        return (rows["chosen_ids"][:, :-1], last_labelled(rows["chosen_labels"]).astype(np.int32),
                rows["rejected_ids"][:, :-1], last_labelled(rows["rejected_labels"]).astype(np.int32),
                rows["margin"].reshape(-1).astype(np.float32))

    def loss_tokens(self, inputs: tuple) -> int:
        return len(inputs[0])  # pairs

    def attach(self, model: nn.Cell, cfg) -> nn.Cell:
        return RewardModel(model, self.seed)

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return PairwiseLoss(model, self.cfg.center_coefficient)


class RewardModel(nn.Cell):
    """tokens [B, S], ends [B] (index of each row's last real token) -> rewards [B] fp32. Shares the causal
    model's trunk (`model.*` parameters keep their names) and drops its LM head."""

    def __init__(self, lm: nn.Cell, seed: int):
        super().__init__(auto_prefix=False)
        self.model = lm.model
        hidden = lm.model.norm_out.weight.shape[0]
        rng = np.random.default_rng(seed + 1)
        self.score = Parameter(Tensor(rng.normal(0.0, 1.0 / np.sqrt(hidden + 1), (1, hidden)).astype(np.float32)),
                               name="score.weight")

    def construct(self, tokens, ends):
        h = self.model(tokens).astype(ms.float32)  # [B, S, hidden]
        pick = ops.one_hot(ends, h.shape[1], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [B, S]
        last = (h * pick.expand_dims(-1)).sum(1)  # [B, hidden]
        return (last * self.score).sum(-1)


class PairwiseLoss(nn.Cell):
    def __init__(self, reward_model: nn.Cell, center_coefficient: float):
        super().__init__(auto_prefix=False)
        self.reward_model, self.center = reward_model, center_coefficient

    def construct(self, chosen_ids, chosen_end, rejected_ids, rejected_end, margin):
        rewards = self.reward_model(ops.cat((chosen_ids, rejected_ids)), ops.cat((chosen_end, rejected_end)))
        chosen, rejected = ops.split(rewards, chosen_ids.shape[0])
        diff = chosen - rejected
        loss = ops.softplus(margin - diff).mean()  # -log sigmoid(diff - margin)
        if self.center > 0:
            loss = loss + self.center * ((chosen + rejected) ** 2).mean()
        return (loss, (diff > 0).astype(ms.float32).mean(), diff.mean(), rewards.mean(), (rewards ** 2).mean(),
                rewards.min(), rewards.max())
