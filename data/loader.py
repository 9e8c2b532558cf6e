"""Batches of packed rows from a 1-D token stream.

Row i is the window tokens[i*seq_len : i*seq_len + seq_len + 1]: consecutive rows share one token, so
every token after the first is a target exactly once per epoch (inputs row[:-1], targets row[1:]).
"""
from __future__ import annotations

from typing import Dict, List

import numpy as np

from data.errors import DataError


def num_rows(tokens: np.ndarray, seq_len: int) -> int:
    return max(len(tokens) - 1, 0) // seq_len


class PackedBatches:
    """Endless shuffled training batches, sharded over data-parallel ranks.

    The global sample order is epoch after epoch of rows, each epoch a permutation drawn from
    `default_rng(seed + epoch)`; rank r takes global samples r, r + dp_size, r + 2*dp_size, ...
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 0):
        self.rows = num_rows(tokens, seq_len)
        if self.rows == 0:
            raise DataError(f"data too small for seq_len={seq_len}: {len(tokens)} tokens, need at least "
                            f"{seq_len + 1}; lower data.seq_len or add data")
        self.tokens, self.seq_len, self.micro_batch_size = tokens, seq_len, micro_batch_size
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.consumed = 0  # samples this rank has taken
        self._order = (-1, np.zeros(0, np.int64))  # (epoch, its permutation of rows)

    @property
    def epoch(self) -> int:
        """Epoch of the next sample this rank takes."""
        return (self.consumed * self.dp_size + self.dp_rank) // self.rows

    def next_batch(self) -> np.ndarray:
        """int32 [micro_batch_size, seq_len + 1]."""
        rows = [self._row(self.consumed + i) for i in range(self.micro_batch_size)]
        self.consumed += self.micro_batch_size
        return np.stack(rows).astype(np.int32)

    def state_dict(self) -> Dict[str, int]:
        """`consumed` is what resuming needs; `epoch` is for logs; `rows` guards against changed data."""
        return {"epoch": self.epoch, "consumed": self.consumed, "rows": self.rows}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        if state["rows"] != self.rows:
            raise DataError(f"the data loader state was saved with {state['rows']} rows per epoch, but the data "
                            f"now has {self.rows}: data or data.seq_len changed since the checkpoint")
        self.consumed = state["consumed"]

    def _row(self, sample: int) -> np.ndarray:
        epoch, i = divmod(sample * self.dp_size + self.dp_rank, self.rows)
        if self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng(self.seed + epoch).permutation(self.rows))
        start = int(self._order[1][i]) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


def eval_batches(tokens: np.ndarray, seq_len: int, micro_batch_size: int, n_batches: int) -> List[np.ndarray]:
    """The first min(n_batches, rows // micro_batch_size) batches of consecutive rows, unshuffled."""
    n = min(n_batches, num_rows(tokens, seq_len) // micro_batch_size)
    if n == 0:
        raise DataError(f"validation data too small for seq_len={seq_len} and micro_batch_size="
                        f"{micro_batch_size}: {len(tokens)} tokens; raise data.val_fraction, lower data.seq_len "
                        f"or add data")
    rows = [tokens[i * seq_len:i * seq_len + seq_len + 1] for i in range(n * micro_batch_size)]
    return [np.stack(rows[b * micro_batch_size:(b + 1) * micro_batch_size]).astype(np.int32) for b in range(n)]
