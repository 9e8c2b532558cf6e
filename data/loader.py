"""Training batches in the blended order, and fixed validation batches, read from the MindRecord rows.

Reading goes through `mindspore.dataset.MindDataset` over all sources' shard files (global record id =
the source's first id + row) with a `SubsetSampler` holding the ids of this rank's next CHUNK samples, in
order: MindDataset accepts SubsetSampler (it becomes MindRecord's own subset sampler), keeps the given
order and repeats, and reads with its own threads. A sampler may hold at most as many ids as the files
have rows, hence the chunks; the next chunk's pipeline is started while the current one is consumed.
"""
from __future__ import annotations

import math
from typing import Dict, Iterator, List

import mindspore.dataset as ds
import numpy as np

from data.cache import PreparedData
from data.errors import DataError
from data.mixing import BlendedOrder, Schedule, mix_weights

CHUNK = 4096  # samples of this rank per MindDataset pipeline
READ_THREADS = 2  # MindDataset num_parallel_workers


class BlendedBatches:
    """This rank's training batches in the blended order (data/mixing.py), read from the MindRecord rows.

    Rank r of dp_size takes global samples r, r + dp_size, r + 2*dp_size, ..., so the ranks' samples
    interleave into the single-rank order. `position` counts the samples this rank has consumed; `rows`
    and `weights` (normalized) are per source; `schedule` lists the order's [first sample, weights] segments.
    """

    def __init__(self, prepared: PreparedData, weights: Dict[str, float], micro_batch_size: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, allow_weight_change: bool = False):
        if not 0 <= dp_rank < dp_size:
            raise DataError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
        self.rows = prepared.rows("train")
        self.seq_len = prepared.meta["seq_len"]
        self.columns = prepared.columns
        self.weights = mix_weights(weights, self.rows)
        self.micro_batch_size, self.dp_rank, self.dp_size, self.seed = micro_batch_size, dp_rank, dp_size, seed
        self.allow_weight_change = allow_weight_change
        self._row_counts = np.array(list(self.rows.values()), np.int64)
        self._first_id = np.cumsum(self._row_counts) - self._row_counts  # MindDataset record id of each source's row 0
        self._files = [f for name in self.rows for f in prepared.shard_files(name, "train")]
        self._chunk = min(CHUNK, int(self._row_counts.sum()))  # a SubsetSampler holds at most that many ids
        self._start([(0, self.weights)], position=0)

    @property
    def names(self) -> List[str]:
        return list(self.rows)

    def next_batch(self) -> Dict[str, np.ndarray]:
        """column name -> [micro_batch_size, ...], e.g. PACKED's input_ids int32 [micro_batch_size, seq_len + 1]."""
        rows = [next(self._stream) for _ in range(self.micro_batch_size)]
        self.position += self.micro_batch_size
        return {name: np.stack([row[i] for row in rows]) for i, name in enumerate(self.columns)}

    def samples_by_source(self) -> Dict[str, int]:
        """Samples this rank has consumed from each source."""
        return dict(zip(self.names, self._consumed.tolist()))

    def state_dict(self) -> dict:
        """JSON-serialisable. `position` (samples this rank consumed) is what resuming needs; `schedule`,
        `rows`, `seq_len` and `seed` pin down the order; `epochs` and `samples_by_source` are for logs."""
        return {"position": self.position, "dp_size": self.dp_size, "seed": self.seed, "seq_len": self.seq_len,
                "weights": self.weights, "schedule": [[start, w] for start, w in self.schedule],
                "rows": self.rows, "epochs": dict(zip(self.names, self._epoch.tolist())),
                "samples_by_source": self.samples_by_source()}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the samples `state` consumed (rescaled if dp_size changed), in the same order."""
        for key in ("rows", "seq_len", "seed"):
            if state[key] != getattr(self, key):
                raise DataError(f"the data loader state was saved with {key}={state[key]}, but now {key}="
                                f"{getattr(self, key)}: the data, data.seq_len or trainer.seed changed since the "
                                f"checkpoint; restore them to resume")
        consumed = state["position"] * state["dp_size"]  # by all ranks
        if consumed % self.dp_size:
            raise DataError(f"the checkpoint consumed {consumed} samples over dp={state['dp_size']} ranks, which "
                            f"dp={self.dp_size} ranks cannot split evenly; resume with a dp that divides it")
        schedule = [(int(start), dict(w)) for start, w in state["schedule"]]
        if not _same_weights(schedule[-1][1], self.weights):
            if not self.allow_weight_change:
                raise DataError(f"data.weights changed since the checkpoint (it mixed {_fmt(schedule[-1][1])}, "
                                f"now {_fmt(self.weights)}); restore them, or set data.allow_weight_change=true "
                                f"to continue with the new weights from global sample {consumed}")
            schedule = [seg for seg in schedule if seg[0] < consumed] + [(consumed, self.weights)]
            print(f"[data] the mix changes at global sample {consumed:,} to {_fmt(self.weights)}", flush=True)
        self._start(schedule, consumed // self.dp_size)

    def _start(self, schedule: Schedule, position: int) -> None:
        """Read on from `position` (samples of this rank) in the order `schedule` defines."""
        self.schedule, self.position = schedule, position
        self._order = BlendedOrder(self.rows, schedule, self.seed)
        self._consumed = np.zeros(len(self.rows), np.int64)  # per source, by this rank
        self._epoch = np.zeros(len(self.rows), np.int64)  # per source, epoch of the last row this rank took
        for start in range(0, position, self._chunk):  # replay what the samples before `position` were
            src, draw, _ = self._take(start, min(start + self._chunk, position))
            self._consumed += np.bincount(src, minlength=len(self.rows))
            np.maximum.at(self._epoch, src, draw // self._row_counts[src])
        self._stream = self._rows_from(position)

    def _take(self, start: int, stop: int):
        """(source, draw, row) of this rank's samples [start, stop)."""
        return self._order.take(start * self.dp_size + self.dp_rank, stop * self.dp_size + self.dp_rank,
                                self.dp_size)

    def _rows_from(self, position: int) -> Iterator[np.ndarray]:
        """This rank's rows from `position` on, endlessly; each chunk's pipeline starts a chunk ahead."""
        upcoming = self._open(position)
        while True:
            (rows, src, draw), upcoming = upcoming, self._open(position + self._chunk)
            for i, (row, s, epoch) in enumerate(zip(rows, src, draw // self._row_counts[src])):
                if epoch > self._epoch[s]:
                    self._epoch[s] = epoch
                    if self.dp_rank == 0:
                        print(f"[data] source '{self.names[s]}' has used all its {self._row_counts[s]:,} rows: epoch "
                              f"{epoch + 1} over it (reshuffled) starts at sample {position + i:,}", flush=True)
                self._consumed[s] += 1
                yield row
            position += self._chunk

    def _open(self, position: int):
        """(MindDataset iterator over this rank's samples [position, position + chunk), their sources, draws)."""
        src, draw, row = self._take(position, position + self._chunk)
        sampler = ds.SubsetSampler((self._first_id[src] + row).tolist())
        pipeline = ds.MindDataset(self._files, columns_list=list(self.columns), sampler=sampler,
                                  num_parallel_workers=READ_THREADS)
        return pipeline.create_tuple_iterator(num_epochs=1, output_numpy=True), src, draw


def validation_batches(prepared: PreparedData, micro_batch_size: int, n_batches: int,
                       fit_small: bool = True) -> Dict[str, List[Dict[str, np.ndarray]]]:
    """Per source, its first min(n_batches, val rows // micro_batch_size) batches of validation rows, in order
    (each a dict of columns like BlendedBatches.next_batch). A source that held out fewer rows than a batch (a
    small dataset: packing puts several samples in a row, so even half of 50 samples may not fill 8 rows) is
    one batch of the rows it has, said in one line with the settings that give full batches; `fit_small=False`
    (a graph compiled for one batch shape: sharded runs) refuses it instead."""
    out = {}
    for name, rows in prepared.rows("val").items():
        if prepared.meta["sources"][name]["val"]["docs"] == 0:
            continue  # data.val_fraction = 0, or a one-document source: nothing was held out
        n, size = min(n_batches, rows // micro_batch_size), micro_batch_size
        if n == 0:
            fix = _enough_validation(prepared.meta["sources"][name], prepared.meta["seq_len"], micro_batch_size, rows)
            if not fit_small:
                raise DataError(f"data source '{name}' has {rows} validation rows of data.seq_len + 1 tokens, fewer "
                                f"than one batch of {micro_batch_size}; {fix}")
            n, size = 1, rows
            print(f"[data] source '{name}' held out {rows} validation row(s) of data.seq_len + 1 tokens, fewer than "
                  f"a batch of {micro_batch_size}: it is evaluated as one batch of {rows} (for full batches {fix})",
                  flush=True)
        pipeline = ds.MindDataset(prepared.shard_files(name, "val"), columns_list=list(prepared.columns),
                                  shuffle=False, num_samples=n * size)
        rows = list(pipeline.create_tuple_iterator(num_epochs=1, output_numpy=True))
        out[name] = [{column: np.stack([row[i] for row in rows[b * size:(b + 1) * size]])
                      for i, column in enumerate(prepared.columns)} for b in range(n)]
    return out


def _enough_validation(meta: dict, seq_len: int, micro_batch_size: int, rows: int) -> str:
    """The settings that give a source's validation split one batch: trainer.micro_batch_size=rows always does; a
    data.val_fraction that holds out a quarter more than a batch of rows' tokens (a row holds at most seq_len + 1,
    so that many tokens fill at least a batch of rows whatever the packing), when under one half."""
    docs = meta["train"]["docs"] + meta["val"]["docs"]
    mean_tokens = (meta["train"]["tokens"] + meta["val"]["tokens"]) / max(docs, 1)
    needed = math.ceil(1.25 * micro_batch_size * (seq_len + 1) / max(mean_tokens, 1))
    fraction = math.ceil(1000 * needed / max(docs, 1)) / 1000
    options = [f"data.val_fraction={fraction:g} (about {needed:,} of its {docs:,} samples or documents held out, or "
               f"as many in its val_paths)"] if fraction < 0.5 else []
    options += [f"trainer.micro_batch_size={rows}"] if rows else []
    return "set " + " or ".join(options) + (", or lower data.seq_len" if options else "lower data.seq_len")


def _same_weights(a: Dict[str, float], b: Dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) < 1e-9 for k in a)


def _fmt(weights: Dict[str, float]) -> str:
    return ", ".join(f"{k} {w:.3f}" for k, w in weights.items())
