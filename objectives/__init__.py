"""Training objectives as plug-ins: one module each (objectives/<name>.py), found by `objective.name`.
Importing this package registers every module in base/registry.py OBJECTIVES, so adding one is that module; nothing else
changes.

An objective module exposes (base/objective.py checks it when it registers: a ContractError naming what is missing;
its `Objective` subclasses base.objective.ObjectiveBase, whose optional hooks are None until defined):
  Config                 its typed `objective` group, registered as the preset `objective=<name>`
  check(cfg)             its config rules, e.g. which model families it trains (ConfigError naming the key)
  row_spec(cfg)          data/rows.RowSpec: the prepared rows it reads (columns written to MindRecord); the
                         row layout is the objective's own (e.g. sft_rows in objectives/sft.py)
  Objective(cfg, tokenizer, seed), with
    inputs               names of the step's inputs, in the order its loss cell's construct takes them
    metrics              names of the scalars the loss cell returns after the loss (means over its loss tokens)
    console              the few of them (or of `logged`) the console shows beside the loss, at each logged step
                         and (as val_<name>) at each evaluation: the numbers that say how this objective is doing
    batch(rows, sample)  host side: a batch of rows (dict of columns) whose first sample has global index
                         `sample` (the loop's held-out batches: -1 - i) -> the step's inputs (numpy arrays,
                         in `inputs` order)
    loss_tokens(inputs)  how many tokens of the batch carry loss (the step normalizes by the global count)
    loss_cell(model)     nn.Cell: construct(*inputs) -> (loss, *metrics), loss the mean over its loss tokens;
                         over a causal LM with an auxiliary loss (a router's) it adds that loss where its
                         `has_aux` is true, which validation turns off (models/common/causal_lm.py)
  and optionally, what evaluation (evaluation/) asks of an objective, one hook per kind of measure (it asks no
  objective's name, so a new objective with a hook gets its measures)
    token_nll(model)     a causal LM's per-token NLL: nn.Cell, input_ids int32 [B, S + 1] -> (NLL fp32 [B, S] of
                         each target input_ids[:, 1:], is-greedy bool [B, S]), whose mean over the targets
                         labels[:, 1:] that carry loss (>= 0; the inputs start with input_ids, labels) is the loss:
                         bits per byte (training's val_bpb too), loss by position, tasks and passkey retrieval by
                         log-likelihood (objectives/clm.py TokenNLL)
    fill_mask(model, k)  a masked LM's predictions: nn.Cell, the step's inputs -> (the k most likely tokens int32
                         [B, S, k], the labels [B, S]: the masked tokens, negative elsewhere), with `special_ids`
                         (the tokens never masked): fill-mask top-1 / top-k accuracy (objectives/mlm.py)
    check_checkpoints(cfg)   its rules that read the checkpoints the config names (PPO's reward model), a
                         ConfigError naming the key: the trainer runs them before it builds anything, as
                         validation (check) reads no checkpoint
    memory(cfg)          planner/memory.ObjectiveMemory for `dry_run=true`: sequences per sample, logits kept,
                         extra parameters and what is held besides the trained model (frozen models, caches)
    attach(model, cfg)   after the weights are loaded (and LoRA applied), before the optimizer: returns the
                         cell that is trained and saved (the reward model's head on the decoder), and may
                         build what the loss needs besides it (DPO's frozen reference model)
  and, for chaining stages (recipe/: a stage's missing input comes from an earlier stage that provides it),
    PROVIDES             what a checkpoint of this objective is to later stages, e.g. "reward_model" (rm)
    NEEDS                {what: the config key it goes into} this objective takes from an earlier stage, e.g.
                         {"reward_model": "objective.reward_model"} (ppo)
  and, for an objective that makes its own batches (PPO samples them: objectives/ppo.py),
    next_inputs(draw)    the next micro-batch's inputs, calling draw() -> (rows, sample) for rows as it needs
                         them (no held-out evaluation is run on rows then)
    state_dict() / load_state_dict(state)   what a checkpoint must hold besides the weights (JSON)
    logged               a dict of host-side numbers logged with each step
    timings()            {phase: seconds} spent making inputs since the last call (PPO: rollout, reward,
                         reference): the loop logs each as time/<phase> per step beside time/update and time/step
"""
import importlib
import pkgutil
from types import ModuleType

from base.registry import OBJECTIVES


def check_fine_tuning(cfg, name: str, kinds, data_hint: str) -> None:
    """The rules every fine-tuning objective of a causal decoder shares: the native model, a starting
    checkpoint (or random weights on purpose) and data sources of `kinds`."""
    from base.errors import require
    from models import family

    require(family(cfg.model.family).CAUSAL, "objective", f"objective={name} fine-tunes a causal decoder; "
            f"model.family={cfg.model.family} is not one")
    require(cfg.model.get("impl", "native") == "native", "model.impl", f"objective={name} needs the native model; "
            f"set model.impl=native")
    require(cfg.stage.init_from or cfg.stage.allow_random_init or cfg.dry_run, "stage.init_from",  # (a plan: no weights)
            f"objective={name} fine-tunes a "
            "pretrained model: set stage.init_from=<checkpoint dir>, or stage.allow_random_init=true (and "
            "data.tokenizer.path) to start from random weights on purpose")
    other = sorted({s.kind for s in cfg.data.sources if s.kind not in kinds})
    require(not other, "data.sources", f"objective={name} trains on sources of kind {', '.join(kinds)}, not "
            f"{', '.join(other)}; {data_hint}")


def objective(name: str) -> ModuleType:
    """The objective module named by `objective.name` (a ConfigError naming the choices for an unknown one)."""
    return OBJECTIVES[name]


for _info in pkgutil.iter_modules(__path__):
    if not _info.name.startswith("_"):  # _name.py: helpers of objectives (shared pieces, row layouts)
        OBJECTIVES.add(_info.name, importlib.import_module(f"objectives.{_info.name}"))
