"""Which updates to apply: non-finite and spiking losses are skipped; too many in a row stop the run.

A skipped step still consumes its data (as in Megatron-LM): the next step sees the next batch.
"""
import math
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from base.errors import UserError


class TrainingStopped(UserError, RuntimeError):
    """Raised after `max_consecutive` skipped steps; the last good state has been checkpointed."""


@dataclass
class SpikeGuard:
    factor: float  # a loss above factor x the running mean of accepted losses is a spike; 0: no spike check
    window: int  # accepted losses in the running mean
    max_consecutive: int  # skips in a row that stop the run
    history: List[float] = field(default_factory=list)
    consecutive: int = 0

    def check(self, loss: float) -> Optional[str]:
        """Why this step's update must be skipped, or None."""
        if not math.isfinite(loss):
            return "non-finite loss"
        if self.factor and len(self.history) >= self.window:
            mean = sum(self.history) / len(self.history)
            if loss > self.factor * mean:
                return f"loss spike: {loss:.4f} > {self.factor:g} x running mean {mean:.4f}"
        return None

    def limit(self) -> np.float32:
        """The largest float32 loss that check() accepts, for a graph that decides on the update itself
        (trainer/step.py TrainStep: loss <= limit): the largest float32 at or below factor x the running mean, so
        the float32 comparison gives check()'s verdict exactly; +inf before the window fills or without a check."""
        if not (self.factor and len(self.history) >= self.window):
            return np.float32(np.inf)
        threshold = self.factor * (sum(self.history) / len(self.history))
        below = np.float32(threshold)
        return np.nextafter(below, np.float32(-np.inf)) if below > threshold else below

    def record(self, loss: float, skip_reason: Optional[str]) -> None:
        if skip_reason:
            self.consecutive += 1
            if self.consecutive >= self.max_consecutive:
                raise TrainingStopped(f"{self.consecutive} consecutive steps skipped (last: {skip_reason}); "
                                      "stopping. Lower optim.lr, check the data at the logged positions, or "
                                      "raise trainer.max_consecutive_skips")
            return
        self.consecutive = 0
        self.history = (self.history + [loss])[-self.window:]

    def state_dict(self) -> dict:
        return {"history": self.history, "consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.history, self.consecutive = list(state["history"]), state["consecutive"]
