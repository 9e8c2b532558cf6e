"""Reward model (the second step of RLHF): a scalar score per response, trained on preference pairs.

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
sides), `reward_sq` (mean square, so val_reward_sq - val_mean_reward^2 is the variance over the val set),
and `min_reward` / `max_reward` (each micro-batch's, averaged).

Every checkpoint's state.json holds, under "objective", `val_reward_mean` and `val_reward_std` of the saved
weights over the held-out pairs the run evaluates on (both sides; what val_mean_reward and val_reward_sq say
when evaluation and the save fall on the same step): PPO normalizes its scores with them (objectives/ppo.py
`score_norm`), so a score of 0 means "as good as the average held-out response, chosen and rejected alike".
They are computed at the save, not kept from the last evaluation, so they always describe the weights beside
them.

    python train.py stage=rm stage.init_from=runs/sft/checkpoints/latest data=preferences model=small
"""
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from omegaconf import MISSING

from base.errors import require
from base.objective import ObjectiveBase
from data.formats import kinds
from objectives import check_fine_tuning
from objectives._preference import DATA_HINT, last_labelled, pair_row_spec, require_data_parallel


@dataclass
class Config:
    name: str = MISSING  # rm
    center_coefficient: float = 0.0  # c * mean((r_c + r_r)^2) added to the loss; 0.01 in TRL's docs
    skip_long: bool = False  # leave out pairs with a side longer than data.seq_len instead of refusing them


PROVIDES = "reward_model"  # a later stage's reward model (recipe/: PPO's objective.reward_model)


def check(cfg) -> None:
    check_fine_tuning(cfg, "rm", kinds(pairs=True), DATA_HINT)
    require(cfg.objective.center_coefficient >= 0, "objective.center_coefficient",
            f"must be >= 0, got {cfg.objective.center_coefficient}")
    require_data_parallel(cfg, "rm", "its score head is not in the tensor/pipeline plan")


def row_spec(cfg: Config):
    return pair_row_spec(cfg.skip_long)


def memory(cfg):
    """For the dry-run planner: a pair is two sequences; the model has a score row instead of the LM head, so
    no logits."""
    from models import family
    from planner.memory import ObjectiveMemory

    lm_head = family(cfg.model.family).parameter_count(cfg.model)["lm_head"]
    return ObjectiveMemory(sequences=2, logits=0, params_delta=cfg.model.hidden_size - lm_head)


class Objective(ObjectiveBase):
    inputs = ("chosen_ids", "chosen_end", "rejected_ids", "rejected_end", "margin")
    metrics = ("accuracy", "margin", "mean_reward", "reward_sq", "min_reward", "max_reward")
    console = ("accuracy", "margin")

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg, self.seed = cfg, seed
        self.reward_model, self.val_inputs = None, []  # the held-out batches, for the checkpoint's statistics

    def batch(self, rows: dict, sample: int) -> tuple:
        """Rows hold seq_len + 1 columns, the last always padding: the model reads the first seq_len. The loop's
        held-out batches come with a negative `sample` (trainer/loop.py): they are kept for state_dict."""
        inputs = (rows["chosen_ids"][:, :-1], last_labelled(rows["chosen_labels"]).astype(np.int32),
                  rows["rejected_ids"][:, :-1], last_labelled(rows["rejected_labels"]).astype(np.int32),
                  rows["margin"].reshape(-1).astype(np.float32))
        if sample < 0:
            self.val_inputs.append(inputs)
        return inputs

    def loss_tokens(self, inputs: tuple) -> int:
        return len(inputs[0])  # pairs

    def attach(self, model: nn.Cell, cfg) -> nn.Cell:
        self.reward_model = RewardModel(model, self.seed)
        return self.reward_model

    def state_dict(self) -> dict:
        """The saved weights' reward mean and std (population) over the held-out pairs' both sides; {} without
        held-out pairs. PPO reads them back with val_reward_stats."""
        if not self.val_inputs:
            return {}
        rewards = np.concatenate([self.reward_model(Tensor(np.concatenate((c, r))), Tensor(np.concatenate((ce, re))))
                                  .asnumpy().astype(np.float64) for c, ce, r, re, _ in self.val_inputs])
        return {"val_reward_mean": float(rewards.mean()), "val_reward_std": float(rewards.std()),
                "val_rewards": int(rewards.size)}

    def load_state_dict(self, state: dict) -> None:
        """Nothing to restore: the statistics are computed afresh at every save."""

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return PairwiseLoss(model, self.cfg.center_coefficient)


def val_reward_stats(path: str) -> Optional[Tuple[float, float]]:
    """(val_reward_mean, val_reward_std) from a stage=rm checkpoint's state.json, or None when it has none (no
    held-out pairs, a zero spread, or a checkpoint written before they were saved)."""
    from base import checkpoint

    state = checkpoint.read_state(path).get("objective", {})
    if state.get("val_reward_std", 0.0) > 0:
        return state["val_reward_mean"], state["val_reward_std"]
    return None


class RewardModel(nn.Cell):
    """tokens [B, S], ends [B] (index of each row's last real token) -> rewards [B] fp32. Shares the causal
    model's trunk (`model.*` parameters keep their names) and drops its LM head."""

    def __init__(self, lm: nn.Cell, seed: int):
        super().__init__(auto_prefix=False)
        self.model, self.HAS_AUX = lm.model, lm.HAS_AUX  # the trunk (models/common/causal_lm.py)
        hidden = lm.hidden_size
        rng = np.random.default_rng(seed + 1)
        self.score = Parameter(Tensor(rng.normal(0.0, 1.0 / np.sqrt(hidden + 1), (1, hidden)).astype(np.float32)),
                               name="score.weight")

    def construct(self, tokens, ends):
        return self.last_score(self.model(tokens), ends)

    def with_aux(self, tokens, ends):
        """(rewards, the trunk's auxiliary loss): a router's, for the pairwise loss to add."""
        h, aux = self.model.with_aux(tokens, None, None)
        return self.last_score(h, ends), aux

    def last_score(self, h, ends):
        h = h.astype(ms.float32)  # [B, S, hidden]
        pick = ops.one_hot(ends, h.shape[1], Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))  # [B, S]
        last = (h * pick.expand_dims(-1)).sum(1)  # [B, hidden]
        return (last * self.score).sum(-1)


class PairwiseLoss(nn.Cell):
    def __init__(self, reward_model: nn.Cell, center_coefficient: float):
        super().__init__(auto_prefix=False)
        self.reward_model, self.center, self.has_aux = reward_model, center_coefficient, reward_model.HAS_AUX

    def construct(self, chosen_ids, chosen_end, rejected_ids, rejected_end, margin):
        ids, ends = ops.cat((chosen_ids, rejected_ids)), ops.cat((chosen_end, rejected_end))
        if self.has_aux:
            rewards, aux = self.reward_model.with_aux(ids, ends)
        else:
            rewards, aux = self.reward_model(ids, ends), 0.0
        chosen, rejected = ops.split(rewards, chosen_ids.shape[0])
        diff = chosen - rejected
        loss = ops.softplus(margin - diff).mean()  # -log sigmoid(diff - margin)
        if self.center > 0:
            loss = loss + self.center * ((chosen + rejected) ** 2).mean()
        if self.has_aux:
            loss = loss + aux
        return (loss, (diff > 0).astype(ms.float32).mean(), diff.mean(), rewards.mean(), (rewards ** 2).mean(),
                rewards.min(), rewards.max())
