"""PPO from human feedback, the RLHF of InstructGPT (Ouyang et al. 2022; the recipe of TRL's PPOTrainer): the
policy samples responses to prompts, a reward model scores them, and the policy is pushed towards higher
scores while a per-token KL penalty holds it near the frozen reference.

One rollout per `trainer.micro_batch_size` prompts (data=instructions: each sample's prompt), on the host:
  1. sample a response to each prompt with the policy (its family's generator, models/generation.py: temperature,
     top-k/p, up to `max_new_tokens`, every prompt padded to `max_prompt_len` so one pair of graphs serves every
     rollout; the random stream of a prompt depends on (trainer.seed, rollout, row));
  2. score prompt + response with the reward model (objectives/rm.py; `reward_model` = its checkpoint) at
     the response's last token, normalized (`score_norm`) by the reward model's mean and std over its held-out
     pairs, saved in its checkpoint (`rm_val`: a fixed scale, the one the RM was judged on, so 0 is the
     average held-out response, chosen and rejected alike, and a score means the same in every rollout), or by
     the running mean and std of all scores so far (`running`: a scale that drifts as the policy improves);
     `auto` takes rm_val when the checkpoint holds them. A response that did not end with eos loses
     `missing_eos_penalty`;
  3. the policy's and the reference's log-probabilities of the sampled tokens and the value head's values
     (one forward each, no gradient);
  4. rewards per response token: -kl_coef * KL_t (k1: log pi - log ref; k3: (r - 1) - log r with r = ref / pi,
     Schulman's unbiased low-variance estimator), plus the normalized score at the last token;
  5. GAE (gamma, lam) over the response tokens, advantages whitened over the rollout, returns = A + V.
Then `ppo_epochs` passes over the rollout in `minibatches` shuffled minibatches: one optimizer step each
(the loop's steps), on the clipped policy loss max(-A r, -A clip(r, 1 +- cliprange)), r = pi / pi_old, plus
`vf_coef` x the clipped value loss 0.5 max((V - R)^2, (V_clip - R)^2). The KL coefficient is fixed, or adaptive
(Ziegler et al. 2019): kl_coef *= 1 + clip(KL / kl_target - 1, -0.2, 0.2) * prompts / kl_horizon.

The value head is a linear layer on the policy's own final hidden states (`value_head.weight`, zeros at the
start), trained with it (a shared trunk, as TRL's AutoModelForCausalLMWithValueHead): one forward gives logits
and values, and memory holds one trainable model, which is what fits a CPU box; the price is that value and
policy gradients share the trunk (vf_coef keeps the value term small). The reference is objectives/_reference.py's
(`copy`, or `lora_base` with peft=lora); the reward model is a frozen second model.

Logged per step (TRL's names): from the rollout that step trained on, `objective/scores` (raw RM scores),
`objective/kl` (summed over the response, mean over prompts), `objective/rlhf_reward` (score - kl_coef x KL),
`objective/kl_coef`, `gen_len`, `eos_fraction`; from the update, `policy/approxkl`, `policy/clipfrac`,
`loss/policy`, `loss/value`, `val/clipfrac`, `entropy`. The rollout buffer, the running score moments, the KL
coefficient and the rollout count are saved with every checkpoint, so a resumed run equals an uninterrupted one.
Where the time goes, per step (the loop's trainer/callbacks.py TrainMetrics): `time/rollout` (sampling, the
policy's log-probabilities and values of the samples, rewards and advantages on the host), `time/reward` (the
reward model), `time/reference` (the reference's log-probabilities), `time/update` (the optimizer step on a
minibatch), `time/step` (their sum, up to the loop's own bookkeeping), each part's share as `time_share/<part>`;
the run ends with a `[time]` line of the same over all its steps.
No held-out evaluation (`trainer.eval_every` is ignored): score a checkpoint with `python -m evaluation`.

    python train.py stage=ppo stage.init_from=runs/sft/checkpoints/latest \
        objective.reward_model=runs/rm/checkpoints/latest
"""
import os
import time
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Optional

import numpy as np

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops
from omegaconf import MISSING, OmegaConf

from base import checkpoint
from base.errors import ConfigError, require
from base.objective import ObjectiveBase
from data.errors import DataError
from data.formats import kinds
from data.rows import RowSpec, Split
from models.generation import generates
from objectives import _reference, check_fine_tuning
from objectives.rm import RewardModel, val_reward_stats

ESTIMATORS = ("k1", "k3")
PHASES = ("rollout", "reward", "reference")  # timings(): where a rollout's time goes (the update is the loop's)
SCORE_NORMS = ("auto", "rm_val", "running")


@dataclass
class Config:
    name: str = MISSING  # ppo
    reward_model: Optional[str] = None  # checkpoint of a stage=rm run (same tokenizer and vocabulary)
    max_prompt_len: int = 128  # prompts longer than this are left out
    max_new_tokens: int = 64  # response length limit (data.seq_len >= max_prompt_len + max_new_tokens)
    temperature: float = 1.0  # sampling of rollouts (TRL: 0.7 .. 1.0)
    top_k: int = 0
    top_p: float = 1.0
    kl_coef: float = 0.05  # initial (adaptive) or fixed coefficient of the per-token KL penalty
    kl_estimator: str = "k1"  # k1 | k3
    adaptive_kl: bool = False
    kl_target: float = 6.0  # adaptive: the KL per response it steers to
    kl_horizon: int = 10000  # adaptive: prompts over which it corrects fully
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    ppo_epochs: int = 4  # passes over each rollout
    minibatches: int = 1  # per pass: the rollout is split into this many optimizer steps
    missing_eos_penalty: float = 1.0  # subtracted from the (normalized) score of a response without eos; 0: off
    reference: str = "copy"  # copy | lora_base
    score_norm: str = "auto"  # rm_val (the RM checkpoint's held-out mean/std) | running | auto: rm_val if saved


NEEDS = {"reward_model": "objective.reward_model"}  # taken from an earlier reward-model stage (recipe/)


def check(cfg) -> None:
    o = cfg.objective
    check_fine_tuning(cfg, "ppo", kinds(pairs=False), "use data=instructions (its prompts are sampled from)")
    require(o.reward_model, "objective.reward_model", "stage=ppo needs a reward model: set "
            "objective.reward_model=<checkpoint of a stage=rm run>")
    require(o.kl_estimator in ESTIMATORS, "objective.kl_estimator", f"got {o.kl_estimator!r}; choose one of "
            f"{', '.join(ESTIMATORS)}")
    require(o.kl_coef >= 0, "objective.kl_coef", f"must be >= 0, got {o.kl_coef}")
    require(not o.adaptive_kl or o.kl_target > 0, "objective.kl_target", f"must be > 0, got {o.kl_target}")
    require(o.kl_horizon > 0, "objective.kl_horizon", f"must be > 0, got {o.kl_horizon}")
    require(0 < o.gamma <= 1 and 0 <= o.lam <= 1, "objective.gamma", f"gamma must be in (0, 1] and lam in [0, 1], "
            f"got {o.gamma}, {o.lam}")
    require(o.cliprange > 0 and o.cliprange_value > 0, "objective.cliprange", "cliprange and cliprange_value "
            "must be > 0")
    require(o.ppo_epochs >= 1 and o.minibatches >= 1, "objective.ppo_epochs", "ppo_epochs and minibatches must "
            "be >= 1")
    require(cfg.trainer.micro_batch_size % o.minibatches == 0, "objective.minibatches",
            f"must divide trainer.micro_batch_size={cfg.trainer.micro_batch_size} (the prompts of a rollout)")
    require(cfg.trainer.grad_accum == 1, "trainer.grad_accum", "objective=ppo takes one optimizer step per "
            "minibatch (objective.minibatches); set trainer.grad_accum=1")
    # One device: the rollouts generate outside the training step's graph (the generator's own graphs), which a
    # data-parallel or tensor/pipeline layout does not lay out; the reward and value heads are not in the plan.
    p = cfg.parallel
    require(p.dp == p.tp == p.pp == 1, "parallel", f"objective=ppo runs on one device (parallel={p.name}: its rollouts "
            "generate outside the sharded training graph); set parallel=single")
    require(generates(cfg.model.family), "model.family", f"objective=ppo samples responses with the family's "
            f"generator, and model.family={cfg.model.family} has none")
    require(o.max_prompt_len + o.max_new_tokens <= cfg.model.max_position_embeddings,  # generation's columns
            "objective.max_new_tokens", f"max_prompt_len + max_new_tokens must fit "
            f"model.max_position_embeddings={cfg.model.max_position_embeddings} (the generation cache)")
    require(o.max_prompt_len + o.max_new_tokens <= cfg.data.seq_len, "data.seq_len",
            f"must hold objective.max_prompt_len + max_new_tokens = {o.max_prompt_len + o.max_new_tokens}, "
            f"got {cfg.data.seq_len}")
    require(o.score_norm in SCORE_NORMS, "objective.score_norm", f"got {o.score_norm!r}; choose one of "
            f"{', '.join(SCORE_NORMS)}")
    _reference.check(cfg, "objective.reference", ("copy", "lora_base"))  # responses are sampled while training
    if not os.path.exists(o.reward_model):  # a dry run may plan with a reward model not trained yet (recipe/)
        require(cfg.dry_run, "objective.reward_model", f"{o.reward_model} is not a checkpoint directory")
        return
    reward_model = checkpoint.resolve(o.reward_model)
    if os.path.isdir(reward_model):
        rm = OmegaConf.load(os.path.join(reward_model, "config.yaml"))
        require(OmegaConf.select(rm, "objective.name") == "rm", "objective.reward_model",
                f"{o.reward_model} is not a reward-model checkpoint (its objective is "
                f"{OmegaConf.select(rm, 'objective.name')}); train one with stage=rm")
        require(rm.model.vocab_size == cfg.model.vocab_size, "objective.reward_model",
                f"its vocabulary ({rm.model.vocab_size}) differs from the policy's ({cfg.model.vocab_size}); the "
                f"reward model must share the policy's tokenizer")
        checkpoint.check_same_tokenizer("objective.reward_model", f"the reward model {o.reward_model}",
                                        checkpoint.tokenizer_of(reward_model), "the policy's data",
                                        cfg.data.tokenizer.path)
        require(o.score_norm != "rm_val" or val_reward_stats(reward_model), "objective.score_norm",
                f"rm_val normalizes scores by the reward model's held-out mean and std, and "
                f"{os.path.join(reward_model, 'state.json')} has no objective.val_reward_mean/val_reward_std "
                f"(an RM run without val pairs, or from before they were saved); train the reward model with "
                f"held-out pairs (a source's val_paths, or data.val_fraction > 0), or set objective.score_norm=running")
    else:
        raise ConfigError("objective.reward_model", f"{o.reward_model} is not a checkpoint directory")


def row_spec(cfg: Config) -> RowSpec:
    return RowSpec(name=f"prompts-{cfg.max_prompt_len}", columns=("prompt_ids", "prompt_len"),
                   schema=lambda seq_len: {"prompt_ids": {"type": "int32", "shape": [seq_len + 1]},
                                           "prompt_len": {"type": "int32", "shape": [1]}},
                   build=partial(prompt_rows, cfg.max_prompt_len))


def prompt_rows(max_prompt_len: int, split: Split, seq_len: int, tokenizer) -> Iterator[dict]:
    """PPO's rows: each sample's prompt (its tokens before the first that carries loss), left-aligned and
    padded to seq_len + 1, and its length; prompts longer than `max_prompt_len` are left out (counted)."""
    if split.loss_mask is None or split.margin is not None:
        raise DataError(f"{split.where}: holds {'documents' if split.loss_mask is None else 'preference pairs'}, "
                        f"not instruction samples; objective=ppo samples responses to the prompts of kinds "
                        f"{', '.join(kinds(pairs=False))} (data=instructions)")
    tokens, mask = np.asarray(split.tokens), np.asarray(split.loss_mask)
    kept = 0
    for a, b in zip(split.offsets[:-1], split.offsets[1:]):
        n = int(np.argmax(mask[a:b] > 0)) if mask[a:b].any() else int(b - a)
        if not 0 < n <= max_prompt_len:
            continue
        ids = np.full(seq_len + 1, tokenizer.pad_id, np.int32)
        ids[:n] = tokens[a:a + n]
        kept += 1
        yield {"prompt_ids": ids, "prompt_len": np.array([n], np.int32)}
    print(f"[data] {split.where}: {kept:,} of {len(split.offsets) - 1:,} prompts of at most {max_prompt_len} tokens",
          flush=True)


def memory(cfg):
    """For the dry-run planner: an update runs micro_batch_size / minibatches sequences and keeps their fp32
    log-probabilities; the trained model gains the value row. Besides it: the reference, the frozen reward
    model (fp32, no LM head) and the rollout's KV cache (Llama's generation: K and V per layer, [B, kv heads,
    max_prompt_len + max_new_tokens, head dim] in the compute dtype). Rollouts and updates alternate, so the
    cache is never alive with the update's activations: counting both makes the total an upper bound."""
    from models import family
    from planner.memory import DTYPE_BYTES, ObjectiveMemory

    m, o = cfg.model, cfg.objective
    rm = m  # a reward model not trained yet (a recipe's plan): the policy's shape, as RLHF pipelines usually have it
    if os.path.exists(o.reward_model):
        rm = OmegaConf.load(os.path.join(checkpoint.resolve(o.reward_model), "config.yaml")).model
    counts = family(rm.family).parameter_count(rm)
    columns = o.max_prompt_len + o.max_new_tokens
    cache = (2 * m.num_layers * cfg.trainer.micro_batch_size * m.num_kv_heads * columns
             * (m.hidden_size // m.num_heads) * DTYPE_BYTES[cfg.precision.compute_dtype])
    extra = (*_reference.memory_rows(cfg),
             ("reward model", 4.0 * (counts["total"] - counts["lm_head"] + rm.hidden_size), "frozen, fp32"),
             ("rollout KV cache", cache, f"{cfg.trainer.micro_batch_size} prompts x {columns} columns"))
    return ObjectiveMemory(sequences=1 / o.minibatches, params_delta=m.hidden_size, extra=extra)


# --- the numbers of a rollout (NumPy; tests compare them with plain loops) ----------------------------------

def kl_per_token(logp: np.ndarray, ref_logp: np.ndarray, estimator: str) -> np.ndarray:
    log_ratio = ref_logp - logp
    return -log_ratio if estimator == "k1" else np.expm1(log_ratio) - log_ratio


def gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float):
    """(advantages, returns) [B, T] over the masked positions of each row (one contiguous span), the value
    after the span's end taken as 0."""
    advantages = np.zeros_like(values)
    last = np.zeros(values.shape[0])
    next_value = np.zeros(values.shape[0])
    for t in reversed(range(values.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = np.where(m > 0, delta + gamma * lam * last, 0.0)
        next_value = np.where(m > 0, values[:, t], 0.0)
        advantages[:, t] = last
    return advantages, (advantages + values) * mask


def whiten(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """(x - mean) / std over the masked entries (unbiased variance, as TRL's masked_whiten); 0 elsewhere."""
    n = mask.sum()
    mean = (x * mask).sum() / n
    var = (((x - mean) ** 2) * mask).sum() / max(n - 1, 1)
    return (x - mean) / np.sqrt(var + 1e-8) * mask


# --- cells ------------------------------------------------------------------------------------------------------

class PolicyWithValue(nn.Cell):
    """The causal LM and a value head on its final hidden states: tokens -> (logits [B, S, vocab], values [B, S])."""

    def __init__(self, lm: nn.Cell):
        super().__init__(auto_prefix=False)  # the LM's names stay; the head is value_head.weight
        self.lm, self.HAS_AUX = lm, lm.HAS_AUX  # the causal-LM interface (models/common/causal_lm.py)
        self.value_head = Parameter(Tensor(np.zeros((1, lm.hidden_size), np.float32)), name="value_head.weight")

    def construct(self, tokens):
        h = self.lm.model(tokens)
        return self.lm.head(h), (h.astype(ms.float32) * self.value_head).sum(-1)

    def with_aux(self, tokens):
        """(logits, values, the trunk's auxiliary loss): a router's, for the PPO loss to add."""
        h, aux = self.lm.model.with_aux(tokens, None, None)
        return self.lm.head(h), (h.astype(ms.float32) * self.value_head).sum(-1), aux


class PolicyForward(nn.Cell):
    """tokens [B, S + 1] -> the policy's log-probabilities of tokens[:, 1:] and its values."""

    def __init__(self, policy: PolicyWithValue):
        super().__init__(auto_prefix=False)
        self.policy = policy

    def construct(self, tokens):
        logits, values = self.policy(tokens[:, :-1])
        return _reference.token_logps(logits, tokens[:, 1:])[0], values


class ReferenceForward(nn.Cell):
    """tokens [B, S + 1] -> the frozen reference's log-probabilities of tokens[:, 1:] (a cell of its own, so
    the rollout's time in the reference is measured apart from the policy's)."""

    def __init__(self, reference: nn.Cell):
        super().__init__(auto_prefix=False)
        self.reference = reference

    def construct(self, tokens):
        return _reference.token_logps(self.reference(tokens[:, :-1]), tokens[:, 1:])[0]


class PPOLoss(nn.Cell):
    def __init__(self, policy: PolicyWithValue, cfg: Config):
        super().__init__(auto_prefix=False)
        self.policy, self.has_aux = policy, policy.HAS_AUX
        self.clip, self.clip_v, self.vf_coef = cfg.cliprange, cfg.cliprange_value, cfg.vf_coef

    def construct(self, tokens, mask, old_logp, advantages, returns, old_values):
        if self.has_aux:
            logits, values, aux = self.policy.with_aux(tokens[:, :-1])
        else:
            (logits, values), aux = self.policy(tokens[:, :-1]), 0.0
        logp, all_logp = _reference.token_logps(logits, tokens[:, 1:])
        n = ops.maximum(mask.sum(), 1.0)
        log_ratio = logp - old_logp
        ratio = ops.exp(log_ratio)
        pg1 = -advantages * ratio
        pg2 = -advantages * ops.clip_by_value(ratio, 1.0 - self.clip, 1.0 + self.clip)
        pg_loss = (ops.maximum(pg1, pg2) * mask).sum() / n
        clipped = old_values + ops.clip_by_value(values - old_values, -self.clip_v, self.clip_v)
        v1, v2 = (values - returns) ** 2, (clipped - returns) ** 2
        vf_loss = 0.5 * (ops.maximum(v1, v2) * mask).sum() / n
        entropy = (-(ops.exp(all_logp) * all_logp).sum(-1) * mask).sum() / n
        loss = pg_loss + self.vf_coef * vf_loss
        if self.has_aux:
            loss = loss + aux
        return (loss, 0.5 * ((log_ratio ** 2) * mask).sum() / n,
                ((pg2 > pg1).astype(ms.float32) * mask).sum() / n, pg_loss, vf_loss,
                ((v2 > v1).astype(ms.float32) * mask).sum() / n, entropy)


class Objective(ObjectiveBase):
    inputs = ("tokens", "mask", "old_logp", "advantages", "returns", "old_values")
    metrics = ("policy/approxkl", "policy/clipfrac", "loss/policy", "loss/value", "val/clipfrac", "entropy")
    console = ("objective/scores", "objective/kl")  # the rollout's reward-model score and KL (`logged`)

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg, self.tokenizer, self.seed = cfg, tokenizer, seed
        self.kl_coef, self.rollouts = cfg.kl_coef, 0
        self.score_moments = [0, 0.0, 0.0]  # running: count, mean, sum of squared deviations (Welford) of scores
        self.score_stats = None  # rm_val: (mean, std) the reward model's checkpoint holds
        self.buffer: list = []  # the current rollout's remaining minibatches (tuples of arrays)
        self.logged: dict = {}  # the rollout's numbers, logged with each step trained on it
        self.seconds = dict.fromkeys(PHASES, 0.0)  # spent in each phase of the rollouts since timings() last read

    # --- the loop's hooks -----------------------------------------------------------------------------------

    def attach(self, model: nn.Cell, cfg) -> nn.Cell:
        from base import checkpoint
        from base.schema import is_sharded
        from models import build_model, family
        from models.generation import generator

        self.reference = _reference.build_reference(model, cfg, self.cfg.reference)
        rm_path = checkpoint.resolve(self.cfg.reward_model)
        rm_model = OmegaConf.load(os.path.join(rm_path, "config.yaml")).model
        rm_model = OmegaConf.merge(OmegaConf.structured(family(rm_model.family).Config), rm_model)  # newer keys
        reward_model = RewardModel(build_model(rm_model, cfg.data.seq_len, cfg.precision.compute_dtype,
                                               cfg.device.target, cfg.trainer.seed, is_sharded(cfg.parallel)), 0)
        checkpoint.load_weights(rm_path, reward_model)
        reward_model.update_parameters_name("reward.")
        for p in reward_model.get_parameters():
            p.requires_grad = False
        reward_model.set_train(False)
        self.reward_model, self.lm, self.generator = reward_model, model, generator(cfg.model.family, model)
        self.score_stats = val_reward_stats(rm_path) if self.cfg.score_norm != "running" else None
        print("[ppo] scores normalized by " + (f"the reward model's held-out mean {self.score_stats[0]:.4f} and std "
              f"{self.score_stats[1]:.4f}" if self.score_stats else "their running mean and std"), flush=True)
        self.policy = PolicyWithValue(model)
        self.policy_forward, self.reference_forward = PolicyForward(self.policy), ReferenceForward(self.reference)
        return self.policy

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        return PPOLoss(model, self.cfg)

    def next_inputs(self, draw: Callable[[], tuple]) -> tuple:
        """The next minibatch of the current rollout; a new rollout from `draw()` (rows, sample) when it is spent."""
        if not self.buffer:
            began, scoring = time.perf_counter(), self.seconds["reward"] + self.seconds["reference"]
            self.buffer = self.rollout(*draw())
            scoring = self.seconds["reward"] + self.seconds["reference"] - scoring
            self.seconds["rollout"] += time.perf_counter() - began - scoring  # reading the prompts too
        return self.buffer.pop(0)

    def batch(self, rows: dict, sample: int) -> tuple:
        raise NotImplementedError("objective=ppo makes its batches by sampling (next_inputs), not from rows")

    def loss_tokens(self, inputs: tuple) -> int:
        return int(inputs[1].sum())

    def timings(self) -> dict:
        """{phase: seconds} of the rollouts since the last call: rollout (sampling, the policy's log-probabilities
        and values of the samples, rewards and advantages on the host), reward (the reward model's scores),
        reference (the reference's log-probabilities)."""
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out

    def state_dict(self) -> dict:
        return {"kl_coef": self.kl_coef, "rollouts": self.rollouts, "score_moments": list(self.score_moments),
                "logged": self.logged, "buffer": [[a.tolist() for a in mb] for mb in self.buffer]}

    def load_state_dict(self, state: dict) -> None:
        self.kl_coef, self.rollouts, self.logged = state["kl_coef"], state["rollouts"], state["logged"]
        self.score_moments = state["score_moments"]
        dtypes = (np.int32,) + (np.float32,) * 5
        self.buffer = [tuple(np.array(a, d) for a, d in zip(mb, dtypes)) for mb in state["buffer"]]

    # --- one rollout -----------------------------------------------------------------------------------------

    def rollout(self, rows: dict, sample: int) -> list:
        c, tok = self.cfg, self.tokenizer
        prompts = [row[:n].tolist() for row, n in zip(rows["prompt_ids"], rows["prompt_len"].reshape(-1))]
        self.lm.set_train(False)
        out = self.generator.generate(prompts, c.max_new_tokens, temperature=c.temperature, top_k=c.top_k,
                                      top_p=c.top_p, eos_id=tok.eos_id, pad_id=tok.pad_id,
                                      seed=self.seed * 1_000_003 + self.rollouts,
                                      rows=range(sample, sample + len(prompts)), prompt_len=c.max_prompt_len)
        self.lm.set_train(True)
        b, width = len(prompts), rows["prompt_ids"].shape[1]
        tokens = np.full((b, width), tok.pad_id, np.int32)
        mask = np.zeros((b, width - 1), np.float32)  # target positions that are response tokens
        ends, eos = np.zeros(b, np.int32), np.zeros(b, bool)
        for i, (p, s) in enumerate(zip(prompts, out.samples)):
            response = s.tokens + ([tok.eos_id] if s.finish_reason == "eos" else [])
            eos[i] = s.finish_reason == "eos"
            seq = p + response
            tokens[i, :len(seq)] = seq
            mask[i, len(p) - 1:len(seq) - 1] = 1.0
            ends[i] = len(seq) - 1
        logp, values = (x.asnumpy().astype(np.float64) for x in self.policy_forward(Tensor(tokens)))
        start = time.perf_counter()
        ref_logp = self.reference_forward(Tensor(tokens)).asnumpy().astype(np.float64)
        scored = time.perf_counter()
        scores = self.reward_model(Tensor(tokens[:, :-1]), Tensor(ends)).asnumpy().astype(np.float64)
        self.seconds["reference"] += scored - start
        self.seconds["reward"] += time.perf_counter() - scored
        mean, std = self.score_stats if self.score_stats else self._update_moments(scores)
        normalized = (scores - mean) / std - c.missing_eos_penalty * ~eos
        kl = kl_per_token(logp, ref_logp, c.kl_estimator) * mask
        rewards = -self.kl_coef * kl
        rewards[np.arange(b), ends - 1] += normalized  # at the last response token's target position
        values *= mask
        advantages, returns = gae(rewards, values, mask, c.gamma, c.lam)
        advantages = whiten(advantages, mask)
        kl_sum = kl.sum(1)
        self.logged = {"objective/scores": float(scores.mean()), "objective/kl": float(kl_sum.mean()),
                       "objective/rlhf_reward": float((scores - self.kl_coef * kl_sum).mean()),
                       "objective/kl_coef": float(self.kl_coef), "gen_len": float(mask.sum(1).mean()),
                       "eos_fraction": float(eos.mean())}
        if c.adaptive_kl:
            error = np.clip(kl_sum.mean() / c.kl_target - 1, -0.2, 0.2)
            self.kl_coef *= 1 + error * b / c.kl_horizon
        rng = np.random.default_rng([self.seed, self.rollouts])
        self.rollouts += 1
        arrays = (tokens, mask, logp * mask, advantages, returns, values)
        size = b // c.minibatches
        minibatches = []
        for _ in range(c.ppo_epochs):
            order = rng.permutation(b)
            for k in range(c.minibatches):
                pick = order[k * size:(k + 1) * size]
                minibatches.append(tuple(a[pick].astype(np.int32 if j == 0 else np.float32)
                                         for j, a in enumerate(arrays)))
        return minibatches

    def _update_moments(self, scores) -> tuple:
        """Adds `scores` to the running moments; returns (mean, std), std 1 until there are two scores."""
        n, mean, m2 = self.score_moments
        for x in scores:
            n += 1
            delta = x - mean
            mean += delta / n
            m2 += delta * (x - mean)
        self.score_moments = [n, mean, m2]
        return mean, (np.sqrt(m2 / (n - 1)) if n > 1 else 1.0) or 1.0
