"""Megatron-style blending: which row of which source every training sample is, deterministically.

A weight is the fraction of packed training rows drawn from a source (weights are normalized to sum to 1;
none given: in proportion to the sources' rows, i.e. every row once per epoch of the whole mix).

Order: the d-th draw (d = 0, 1, ...) from source s gets the key (d + 0.5) / w_s, and the samples are all
draws in increasing key order, ties in config order (the Sainte-Laguë divisor sequence). After any number
n of samples, source s has supplied round(n * w_s) of them, give or take one or two: the realized mix
tracks the weights at every prefix, not just on average.

Rows: source s's d-th draw is row perm_e[d mod R_s] of its epoch e = d // R_s (R_s: its training rows),
perm_e a permutation seeded by (seed, crc32(source name), e). A source that runs out starts a new,
reshuffled epoch over itself, independently of the others.

Weight changes: the order is a schedule of segments [(first global sample, weights), ...]; a segment
restarts the divisor sequence with its weights, while each source's draws (hence rows) continue where
the previous segment left them, so a change repeats or skips no row.
"""
from __future__ import annotations

import difflib
import math
import zlib
from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

from data.errors import DataError

Schedule = List[Tuple[int, Dict[str, float]]]


def mix_weights(weights: Mapping[str, float], rows: Mapping[str, int]) -> Dict[str, float]:
    """Normalized weights in source order (`rows`' keys); {} -> in proportion to the rows."""
    check_weights(weights, list(rows))
    raw = {name: float(weights[name]) if weights else float(n) for name, n in rows.items()}
    total = sum(raw.values())
    return {name: w / total for name, w in raw.items()}


def check_weights(weights: Mapping[str, float], names: Sequence[str]) -> None:
    """DataError naming the key unless `weights` is {} or gives every source a weight > 0."""
    for key, w in weights.items():
        if key not in names:
            hint = difflib.get_close_matches(key, names, n=1)
            raise DataError(f"data.weights.{key}: no source named '{key}'"
                            + (f"; did you mean data.weights.{hint[0]}?" if hint else
                               f"; the sources are {', '.join(names)}"))
        if not isinstance(w, (int, float)) or not w > 0:
            raise DataError(f"data.weights.{key}: must be a number > 0, got {w!r}; to leave a source out of "
                            f"the mix remove it from data.sources")
    missing = [n for n in names if n not in weights]
    if weights and missing:
        raise DataError(f"data.weights: no weight for {', '.join(missing)}; give every source a weight, "
                        f"or none to sample them in proportion to their rows")


class BlendedOrder:
    """Global training samples as (source index, draw index, row), generated block by block from 0."""

    def __init__(self, rows: Mapping[str, int], schedule: Schedule, seed: int, block: int = 1 << 16):
        self.names = list(rows)
        self.rows = np.array([rows[n] for n in self.names], np.int64)
        self.schedule = [(int(start), np.array([w[n] for n in self.names], np.float64)) for start, w in schedule]
        self.seed, self.block = seed, block
        self._perms: Dict[Tuple[int, int], np.ndarray] = {}
        self._reset()

    def take(self, start: int, stop: int, step: int = 1) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(source index, draw index, row) of global samples range(start, stop, step). Samples before
        `start` are forgotten: asking for them again regenerates the order from sample 0."""
        if start < self._first:
            self._reset()
        while self._end < stop:
            self._extend()
        cut = start - self._first
        self._src, self._draw, self._first = self._src[cut:], self._draw[cut:], start
        src, draw = self._src[:stop - start:step], self._draw[:stop - start:step]
        return src, draw, self._rows_of(src, draw)

    def _reset(self) -> None:
        self._first = self._end = 0  # the buffers hold global samples [_first, _end)
        self._src, self._draw = np.zeros(0, np.int16), np.zeros(0, np.int64)
        self._drawn = np.zeros(len(self.names), np.int64)  # per source, before _end
        self._segment, self._segment_drawn = 0, np.zeros(len(self.names), np.int64)

    def _extend(self) -> None:
        nxt = self._segment + 1
        segment_end = self.schedule[nxt][0] if nxt < len(self.schedule) else math.inf
        if self._end >= segment_end:
            self._segment, self._segment_drawn = nxt, np.zeros(len(self.names), np.int64)
            return
        n = int(min(self.block, segment_end - self._end))
        src = self._divisor_sequence(n, self.schedule[self._segment][1])
        draw = np.empty(n, np.int64)
        for s in range(len(self.names)):
            mine = src == s
            draw[mine] = self._drawn[s] + np.arange(mine.sum())
            self._drawn[s] += mine.sum()
            self._segment_drawn[s] += mine.sum()
        self._src, self._draw = np.concatenate([self._src, src]), np.concatenate([self._draw, draw])
        self._end += n

    def _divisor_sequence(self, n: int, weights: np.ndarray) -> np.ndarray:
        """The sources of the segment's next n samples: the n smallest keys among each source's next
        candidates, with enough candidates that no source runs out of them."""
        margin = len(weights) + 2
        while True:
            counts = np.ceil(n * weights).astype(np.int64) + margin
            src = np.repeat(np.arange(len(weights), dtype=np.int16), counts)
            d = np.concatenate([self._segment_drawn[s] + np.arange(c) for s, c in enumerate(counts)])
            chosen = src[np.lexsort((src, (d + 0.5) / weights[src]))[:n]]
            if np.all(np.bincount(chosen, minlength=len(weights)) < counts):
                return chosen
            margin *= 2

    def _rows_of(self, src: np.ndarray, draw: np.ndarray) -> np.ndarray:
        rows = np.empty(len(src), np.int64)
        epochs = draw // self.rows[src]
        for s, e in set(zip(src.tolist(), epochs.tolist())):
            mine = (src == s) & (epochs == e)
            rows[mine] = self._permutation(s, e)[draw[mine] % self.rows[s]]
        return rows

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self._perms:
            if len(self._perms) > 2 * len(self.names):
                self._perms.clear()
            rng = np.random.default_rng([self.seed, zlib.crc32(self.names[s].encode()), epoch])
            self._perms[s, epoch] = rng.permutation(self.rows[s])
        return self._perms[s, epoch]
