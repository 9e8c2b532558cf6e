"""The trainer's parts own their state (OLMo-core's Stateful: `state_dict()` / `load_state_dict(state)`), and a
checkpoint is what every part says it is: Checkpointer asks each part when it saves and hands each its own when
it resumes, so a new part (an objective's rollout buffer, a loss scale) is one more entry, not more of the loop.

    module          the weights and the optimizer state, in their own files (trainer/module.py save / load)
    RunState        the run's id, its step, its skipped steps, the tokens it has seen, the optimizer preset
    data            the training stream's position (data/)
    objective       an objective's own state (PPO's rollout buffer and KL coefficient), where it has any
    guard           the spike guard's recent losses (trainer/guard.py)
    rng             Python's, NumPy's and MindSpore's random generators (RandomState)
    loss_scale      the dynamic loss scale (trainer/step.py DynamicLossScale; None under a static one)

The JSON a checkpoint holds (base/checkpoint.py) keeps each part's state under its name, the run's at the top.
"""
from dataclasses import dataclass
from typing import Dict, Optional, Protocol

from base import checkpoint
from trainer.runtime import rng_state, set_rng_state


class Stateful(Protocol):
    def state_dict(self): ...

    def load_state_dict(self, state) -> None: ...


class RandomState:
    """The process's random generators (trainer/runtime.py rng_state)."""

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state)


@dataclass
class RunState:
    """The run's own counters: `step` is the last one saved or resumed."""
    run_id: str
    optimizer: str  # the optimizer preset its state belongs to (base/checkpoint.py check_optimizer)
    tokens_per_step: int
    step: int = 0
    skipped_steps: int = 0

    def state_dict(self) -> dict:
        return {"tokens_seen": self.step * self.tokens_per_step, "run_id": self.run_id, "optimizer": self.optimizer,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.run_id, self.skipped_steps = state["step"], state["run_id"], state["skipped_steps"]


class Checkpointer:
    """Writes checkpoints under `root` (keeping trainer.keep_last and every trainer.keep_every-th) and resumes from
    one, asking the module, the run and every part in `parts` (name -> part; None: a part this run does not have,
    saved as null) for its state."""

    def __init__(self, module, run: RunState, parts: Dict[str, Optional[Stateful]], root: str, cfg,
                 tokenizer_file: str, is_main: bool):
        self.module, self.run, self.parts, self.root, self.cfg = module, run, parts, root, cfg
        self.tokenizer_file, self.is_main = tokenizer_file, is_main

    def save(self, step: int) -> None:
        self.run.step = step
        state = {**self.run.state_dict(),
                 **{name: None if part is None else part.state_dict() for name, part in self.parts.items()}}
        self.module.save(self.root, step, state, self.cfg, self.tokenizer_file, self.is_main)
        if self.is_main:
            checkpoint.prune(self.root, self.cfg.trainer.keep_last, self.cfg.trainer.keep_every)

    def restore(self, path: str, example_inputs: Optional[tuple]) -> None:
        """Every part as checkpoint `path` holds it (`example_inputs`: what a sharded module compiles with before
        it loads its slices)."""
        state = self.module.load(path, example_inputs)
        self.run.load_state_dict(state)
        for name, part in self.parts.items():
            if part is not None and name in state:
                part.load_state_dict(state[name])
