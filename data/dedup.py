"""Exact and near-duplicate removal across all sources: the first occurrence stays.

Documents are offered in a fixed order (sources in config order, documents in reading order), a batch at a
time, so which copy survives is deterministic and a document duplicated across sources stays in the
earlier source. Exact: a document whose digest (of its normalized text) an earlier document that passed the
filters already had. Near: MinHash LSH (data/minhash.py): a document is removed when a document kept before
it shares one of its band keys and agrees on >= near_dedup_threshold of the signature entries.

Memory: 16 B per document for the digests and, per kept document, one 8-byte key and a 4-byte id for each
LSH band (18 bands at the default threshold 0.8: 216 B), all in sorted runs (SortedKeys): 232 MB per million
documents, and about 3x that for the moments the largest runs merge (measured: a million random documents
grew the process by 0.7 GB at most). Signatures are not kept: a candidate's is read back through
`signature_of` (from the work units on disk), and candidates are rare.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from base.schema import CleaningConfig
from data.minhash import band_keys, lsh_bands

STEPS = ("exact_dedup", "near_dedup")


class SortedKeys:
    """A growing multiset of keys (each with an optional value) kept as a few sorted runs, a log-structured
    merge: each add() sorts its batch into a new run and merges it with the last run while that one is no
    longer, so n keys cost O(n log n) to add and a lookup searches O(log n) runs."""

    def __init__(self):
        self._runs: List[Tuple[np.ndarray, Optional[np.ndarray]]] = []

    def add(self, keys: np.ndarray, values: Optional[np.ndarray] = None) -> None:
        order = np.argsort(keys, kind="stable")
        run = (keys[order], None if values is None else values[order])
        while self._runs and len(self._runs[-1][0]) <= len(run[0]):
            run = _merge(self._runs.pop(), run)
        if len(run[0]):
            self._runs.append(run)

    def find(self, keys: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        """(i, value) for every stored key equal to keys[i] (value: its position when added without values)."""
        order = np.argsort(keys, kind="stable")  # sorted queries search the runs in one sweep
        queries = keys[order]
        found_i, found_v = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
        for run_keys, run_values in self._runs:
            lo = np.searchsorted(run_keys, queries, "left")
            hit = run_keys[np.minimum(lo, len(run_keys) - 1)] == queries
            if not hit.any():
                continue
            lo = lo[hit]
            n = np.searchsorted(run_keys, queries[hit], "right") - lo
            pos = np.repeat(lo - np.cumsum(n) + n, n) + np.arange(n.sum())
            found_i.append(np.repeat(order[hit], n))
            found_v.append(pos if run_values is None else run_values[pos].astype(np.int64))
        return np.concatenate(found_i), np.concatenate(found_v)

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + (0 if v is None else v.nbytes) for k, v in self._runs)


def _merge(a: Tuple[np.ndarray, Optional[np.ndarray]], b: Tuple[np.ndarray, Optional[np.ndarray]]):
    """Two sorted runs as one. Timsort finds the two runs and merges them in linear time; each temporary is
    dropped as soon as it is used, which keeps the peak near 3x the two runs' keys."""
    keys = np.concatenate([a[0], b[0]])
    order = np.argsort(keys, kind="stable")
    keys = keys[order]
    values = None if a[1] is None else np.concatenate([a[1], b[1]])[order]
    return keys, values


class Deduplicator:
    """Offer documents in order, a batch at a time; ids count every document offered, from 0."""

    def __init__(self, cfg: CleaningConfig, signature_of: Callable[[int], np.ndarray]):
        self.exact, self.near, self.threshold = cfg.exact_dedup, cfg.near_dedup, cfg.near_dedup_threshold
        self.bands, self.rows = lsh_bands(cfg.near_dedup_threshold)
        self.signature_of = signature_of
        self._digests = SortedKeys()
        self._band_keys = SortedKeys()  # the kept documents' band keys -> their ids
        self._next_id = 0

    def offer(self, digests: np.ndarray, signatures: Optional[np.ndarray]) -> np.ndarray:
        """uint8 per document: 0 kept (and now remembered), else 1 + the index in STEPS of the step removing it.
        `digests`: S16; `signatures`: uint32 [n, NUM_PERM] (None unless near dedup is on)."""
        n = len(digests)
        removed = np.zeros(n, np.uint8)
        if self.exact and n:
            seen = np.zeros(n, bool)
            seen[self._digests.find(digests)[0]] = True
            _, first = np.unique(digests, return_index=True)  # each digest's first document in the batch
            new = first[~seen[first]]
            removed[seen] = 1
            removed[np.setdiff1d(np.arange(n), first)] = 1
            self._digests.add(digests[new])
        if self.near and n:
            rest = np.flatnonzero(removed == 0)
            removed[rest[~self._keep_near(signatures[rest], self._next_id + rest)]] = 2
        self._next_id += n
        return removed

    def _keep_near(self, sigs: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """Which of `sigs` (in order) no kept signature, earlier or in the batch, nearly duplicates; those
        are kept and indexed."""
        keys = band_keys(sigs, self.bands, self.rows)  # [m, bands]
        earlier: Dict[int, Set[int]] = {}  # document of the batch -> ids of kept documents sharing a key
        doc, kept_id = self._band_keys.find(keys.ravel())
        for d, i in zip((doc // self.bands).tolist(), kept_id.tolist()):
            earlier.setdefault(d, set()).add(i)
        _, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
        shared = (counts[inverse.ravel()] > 1).reshape(keys.shape)  # keys another document of the batch has too
        keep = np.ones(len(sigs), bool)
        in_batch: Dict[int, List[int]] = {}  # shared key -> documents of the batch kept with it
        for d in sorted(set(earlier) | set(np.flatnonzero(shared.any(axis=1)).tolist())):
            mine = keys[d][shared[d]].tolist()
            candidates = [self.signature_of(i) for i in earlier.get(d, ())] + \
                [sigs[j] for key in mine for j in in_batch.get(key, ())]
            if any(np.mean(c == sigs[d]) >= self.threshold for c in candidates):
                keep[d] = False
                continue
            for key in mine:
                in_batch.setdefault(key, []).append(d)
        self._band_keys.add(keys[keep].ravel(), np.repeat(ids[keep], self.bands).astype(np.uint32))
        return keep

    @property
    def nbytes(self) -> int:
        return self._digests.nbytes + self._band_keys.nbytes
