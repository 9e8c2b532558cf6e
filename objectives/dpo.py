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
memory); either runs inside the step's graph under stop_gradient. Or `precomputed` (TRL's
precompute_ref_log_probs): in attach() the starting model scores every prepared training and val pair once
(what the reference would say of it, as the loss would compute it), the numbers are kept on the host by the
pair's content, and batch() hands them to the step as two more inputs. Training then holds no reference and
runs one forward per pair instead of two; the price is the pass over the whole data set before step 1, which
is repeated on resume (the starting weights are stage.init_from, so it gives the same numbers: nothing to save).

Logged with TRL's names: `rewards/chosen` and `rewards/rejected` (beta times the policy/reference log-ratio
of each side; per-token means under ipo, as TRL), `rewards/accuracies` (chosen's above rejected's),
`rewards/margins`, `logps/chosen`,
`logps/rejected` (the policy's, summed), and `kl`: the mean over response tokens of the exact next-token
KL(pi || ref) at the data's positions (on both sides). `kl` needs the reference's whole next-token distribution,
which `precomputed` does not keep (vocab floats per token), so that mode does not log it, as TRL does not;
`rewards/chosen - rewards/rejected` still tell how far the policy moved from the reference on the data.

    python train.py stage=dpo stage.init_from=runs/sft/checkpoints/latest data=preferences objective.beta=0.1
"""
import hashlib
import time
from dataclasses import dataclass

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn, ops
from omegaconf import MISSING

from base.errors import require
from base.objective import ObjectiveBase
from data.formats import kinds
from objectives import _reference, check_fine_tuning
from objectives._preference import COLUMNS, DATA_HINT, pair_row_spec, require_data_parallel
from objectives.sft import IGNORE_INDEX

LOSSES = ("sigmoid", "ipo", "hinge")


@dataclass
class Config:
    name: str = MISSING  # dpo
    beta: float = 0.1  # strength of the KL leash to the reference (higher: stay closer)
    loss: str = "sigmoid"  # sigmoid (DPO) | ipo | hinge
    label_smoothing: float = 0.0  # sigmoid only: the probability that a pair's label is flipped (cDPO)
    nll_coefficient: float = 0.0  # weight of the chosen responses' next-token loss (RPO); 0: off
    reference: str = "copy"  # copy | lora_base (peft=lora: the frozen base, shared) | precomputed (none kept)
    skip_long: bool = False  # leave out pairs with a side longer than data.seq_len instead of refusing them


def check(cfg) -> None:
    o = cfg.objective
    check_fine_tuning(cfg, "dpo", kinds(pairs=True), DATA_HINT)
    require(o.beta > 0, "objective.beta", f"must be > 0, got {o.beta}")
    require(o.loss in LOSSES, "objective.loss", f"got {o.loss!r}; choose one of {', '.join(LOSSES)}")
    require(0 <= o.label_smoothing < 0.5, "objective.label_smoothing", f"must be in [0, 0.5), got {o.label_smoothing}")
    require(o.label_smoothing == 0 or o.loss == "sigmoid", "objective.label_smoothing",
            f"applies to loss=sigmoid only, not {o.loss}; set it to 0")
    require(o.nll_coefficient >= 0, "objective.nll_coefficient", f"must be >= 0, got {o.nll_coefficient}")
    _reference.check(cfg, "objective.reference")
    # the reference (copy, lora_base) is a second model in the step graph with no strategies or stages, and
    # `precomputed` scores every pair with the whole model on each device before training
    require_data_parallel(cfg, "dpo", "its reference model is not in the tensor/pipeline plan")


def row_spec(cfg: Config):
    return pair_row_spec(cfg.skip_long)


def memory(cfg):
    """For the dry-run planner: a pair is two sequences, whose fp32 log-probabilities over the vocabulary the
    step keeps for the policy and, for the KL term's backward, for a reference run in the graph."""
    from planner.memory import ObjectiveMemory

    in_graph = cfg.objective.reference in ("copy", "lora_base")
    return ObjectiveMemory(sequences=2, logits=2 if in_graph else 1, extra=_reference.memory_rows(cfg))


SIDES = COLUMNS[:4]  # chosen_ids, chosen_labels, rejected_ids, rejected_labels: what the loss reads of a row


class Objective(ObjectiveBase):
    inputs = SIDES
    metrics = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "kl")
    console = ("rewards/accuracies", "rewards/margins")

    def __init__(self, cfg: Config, tokenizer=None, seed: int = 0):
        self.cfg, self.reference = cfg, None
        self.reference_logps = None  # precomputed: pair key -> (chosen, rejected), filled by attach()
        if cfg.reference == "precomputed":
            self.inputs = SIDES + ("reference_chosen", "reference_rejected")
            self.metrics = self.metrics[:-1]  # no kl (the module docstring says why)

    def batch(self, rows: dict, sample: int) -> tuple:
        inputs = tuple(rows[name] for name in SIDES)
        if self.cfg.reference != "precomputed":
            return inputs
        try:
            logps = np.array([self.reference_logps[key] for key in pair_keys(rows)], np.float32)  # [B, 2]
        except KeyError:
            raise RuntimeError("objective.reference=precomputed: a pair that attach() did not score reached the "
                               "step; the prepared data changed while training") from None
        return inputs + (logps[:, 0], logps[:, 1])

    def loss_tokens(self, inputs: tuple) -> int:
        return len(inputs[0])  # pairs

    def attach(self, model: nn.Cell, cfg) -> nn.Cell:
        """Builds the frozen reference from `model` as it is now (the starting weights), or with `precomputed`
        scores every pair with it, and returns `model`."""
        if self.cfg.reference == "precomputed":
            self.reference_logps = precompute_reference(model, cfg)
        else:
            self.reference = _reference.build_reference(model, cfg, self.cfg.reference)
        return model

    def loss_cell(self, model: nn.Cell) -> nn.Cell:
        if self.reference is None and self.reference_logps is None:
            raise RuntimeError("objective=dpo: attach(model, cfg) builds the reference before loss_cell")
        if self.reference_logps is not None:
            return PrecomputedPreferenceLoss(model, self.cfg)
        return PreferenceLoss(model, self.reference, self.cfg)


def pair_keys(rows: dict) -> list:
    """A key per pair of a batch of rows, from its tokens and labels: how a precomputed reference value finds
    its pair again whatever the order, the epoch or the data-parallel rank that draws it."""
    return [hashlib.blake2b(b"".join(np.ascontiguousarray(rows[name][i]).tobytes() for name in SIDES),
                            digest_size=16).digest() for i in range(len(rows[SIDES[0]]))]


def precompute_reference(model: nn.Cell, cfg) -> dict:
    """pair key -> (chosen, rejected) reference log-probabilities of every prepared training and val pair (of
    every source), as `model` (now: the starting weights) gives them. Batches of trainer.micro_batch_size, the
    shape the loss sees (the last one filled up with its own last row), in the order of the prepared files."""
    import mindspore.dataset as mds

    from data.cache import prepare

    prepared = prepare(cfg.data, row_spec(cfg.objective))
    scorer, b = SequenceLogps(model, cfg.objective.loss == "ipo"), cfg.trainer.micro_batch_size
    training = model.training
    model.set_train(False)  # as build_reference leaves the reference
    out, start = {}, time.time()
    for split in ("train", "val"):
        for source, n in prepared.rows(split).items():
            if n == 0:
                continue
            pipeline = mds.MindDataset(prepared.shard_files(source, split), columns_list=list(SIDES), shuffle=False)
            for rows in pipeline.batch(b).create_dict_iterator(num_epochs=1, output_numpy=True):
                k = len(rows[SIDES[0]])
                full = [np.concatenate([rows[c], np.repeat(rows[c][-1:], b - k, 0)]) for c in SIDES]
                logps = scorer(*map(Tensor, full)).asnumpy()  # [2b]: chosen sides, then rejected
                out.update(zip(pair_keys(rows), zip(logps[:k].tolist(), logps[b:b + k].tolist())))
    model.set_train(training)
    print(f"[dpo] reference log-probabilities of {len(out):,} pairs precomputed in {time.time() - start:.0f} s; "
          f"no reference model is kept", flush=True)
    return out


def _sides(chosen_ids, chosen_labels, rejected_ids, rejected_labels):
    """Both sides stacked for one forward: (ids [2B, S], targets [2B, S] (0 where no loss), mask fp32 [2B, S])."""
    ids = ops.cat((chosen_ids, rejected_ids))[:, :-1]
    targets = ops.cat((chosen_labels, rejected_labels))[:, 1:]
    counted = targets != IGNORE_INDEX
    return ids, ops.select(counted, targets, ops.zeros_like(targets)), counted.astype(ms.float32)


def _sequence_logps(token_logps, mask, mean: bool):
    """[2B]: the masked token log-probabilities summed per side, or (ipo) averaged over its response tokens."""
    logps = (token_logps * mask).sum(1)
    return logps / ops.maximum(mask.sum(1), 1.0) if mean else logps


class SequenceLogps(nn.Cell):
    """A pair batch's four columns -> [2B] sequence log-probabilities of chosen then rejected under `model`, as
    the loss computes the reference's (precomputed mode runs it once per pair before training)."""

    def __init__(self, model: nn.Cell, mean: bool):
        super().__init__(auto_prefix=False)
        self.model, self.mean = model, mean

    def construct(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels):
        ids, targets, mask = _sides(chosen_ids, chosen_labels, rejected_ids, rejected_labels)
        token_logps, _ = _reference.token_logps(self.model(ids), targets)
        return _sequence_logps(token_logps, mask, self.mean)


class PreferenceLoss(nn.Cell):
    """The loss against a reference model run in the same graph (copy, lora_base)."""

    def __init__(self, policy: nn.Cell, reference, cfg: Config):
        super().__init__(auto_prefix=False)
        self.policy, self.reference, self.has_aux = policy, reference, policy.HAS_AUX
        self.beta, self.kind, self.ls, self.nll = cfg.beta, cfg.loss, cfg.label_smoothing, cfg.nll_coefficient

    def policy_logits(self, ids):
        """(the policy's logits, its auxiliary loss: a router's, 0 for a dense model; models/common/causal_lm.py)."""
        if self.has_aux:
            return self.policy.logits_and_aux(ids)
        return self.policy(ids), 0.0

    def construct(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels):
        ids, targets, mask = _sides(chosen_ids, chosen_labels, rejected_ids, rejected_labels)
        logits, aux = self.policy_logits(ids)
        token_logps, logp = _reference.token_logps(logits, targets)  # [2B, S], [2B, S, vocab]
        ref_token_logps, ref_logp = _reference.token_logps(self.reference(ids), targets)
        ref_token_logps, ref_logp = ops.stop_gradient(ref_token_logps), ops.stop_gradient(ref_logp)
        ref_c, ref_r = ops.split(_sequence_logps(ref_token_logps, mask, self.kind == "ipo"), chosen_ids.shape[0])
        kl = ((ops.exp(logp) * (logp - ref_logp)).sum(-1) * mask).sum() / ops.maximum(mask.sum(), 1.0)
        loss, *metrics = self.terms(token_logps, mask, ref_c, ref_r)
        return (loss + aux if self.has_aux else loss, *metrics, kl)

    def terms(self, token_logps, mask, ref_c, ref_r) -> tuple:
        """(loss, the metrics but kl) from the policy's token log-probabilities [2B, S] and the reference's
        sequence log-probabilities of each side [B]."""
        n = ref_c.shape[0]
        pi_c, pi_r = ops.split(_sequence_logps(token_logps, mask, self.kind == "ipo"), n)
        h = (pi_c - pi_r) - (ref_c - ref_r)
        if self.kind == "sigmoid":
            losses = (1 - self.ls) * ops.softplus(-self.beta * h) + self.ls * ops.softplus(self.beta * h)
        elif self.kind == "ipo":
            losses = (h - 1 / (2 * self.beta)) ** 2
        else:
            losses = ops.relu(1 - self.beta * h)
        loss = losses.mean()
        sums = ops.split((token_logps * mask).sum(1), n)
        if self.nll > 0:
            loss = loss - self.nll * sums[0].sum() / ops.maximum(mask[:n].sum(), 1.0)
        reward_c, reward_r = self.beta * (pi_c - ref_c), self.beta * (pi_r - ref_r)
        return (loss, reward_c.mean(), reward_r.mean(), (reward_c > reward_r).astype(ms.float32).mean(),
                (reward_c - reward_r).mean(), sums[0].mean(), sums[1].mean())


class PrecomputedPreferenceLoss(PreferenceLoss):
    """The same loss with the reference's sequence log-probabilities given as inputs (`precomputed`)."""

    def __init__(self, policy: nn.Cell, cfg: Config):
        super().__init__(policy, None, cfg)

    def construct(self, chosen_ids, chosen_labels, rejected_ids, rejected_labels, reference_chosen,
                  reference_rejected):
        ids, targets, mask = _sides(chosen_ids, chosen_labels, rejected_ids, rejected_labels)
        logits, aux = self.policy_logits(ids)
        token_logps, _ = _reference.token_logps(logits, targets)
        loss, *metrics = self.terms(token_logps, mask, reference_chosen, reference_rejected)
        return (loss + aux if self.has_aux else loss, *metrics)
