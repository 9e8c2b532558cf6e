"""MinHash signatures of word 5-gram sets, and an LSH index that finds near duplicates among them.

Words are runs of letters/digits, lowercased; each CJK character is a word of its own (those scripts do not
separate words with spaces). The fraction of equal signature entries estimates the Jaccard similarity of
two documents' 5-gram sets (standard error about 0.04 at 0.8 with 128 permutations).
"""
from __future__ import annotations

import re
import zlib
from collections import defaultdict
from typing import Dict, List, Tuple

import numpy as np

NUM_PERM = 128
SHINGLE_WORDS = 5
_CJK = "\u2e80-\u2fdf\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
_WORD = re.compile(rf"[^\W_{_CJK}]+|[{_CJK}]")
_rng = np.random.default_rng(20240601)  # fixed: signatures must agree across processes and runs
_MIX = _rng.integers(1, 2**63, SHINGLE_WORDS, dtype=np.uint64) * 2 + 1  # odd multipliers, word hash -> 5-gram
_PERM_A = _rng.integers(1, 2**63, NUM_PERM, dtype=np.uint64) * 2 + 1
_PERM_B = _rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)
_CHUNK = 4096  # shingles hashed at once: bounds memory at _CHUNK x NUM_PERM x 8 bytes


def signature(text: str) -> np.ndarray:
    """uint32 [NUM_PERM]: per permutation, the minimum hash over the text's distinct word 5-grams."""
    words = _WORD.findall(text.lower())
    word_hash = np.fromiter((zlib.crc32(w.encode()) for w in words), np.uint64, len(words))
    n = max(len(words) - SHINGLE_WORDS + 1, 1)  # a text shorter than one 5-gram is one shingle
    shingles = np.zeros(n, np.uint64)
    for k in range(min(SHINGLE_WORDS, len(words))):
        shingles += word_hash[k:k + n] * _MIX[k]  # wraps mod 2**64
    shingles = np.unique(shingles)
    sig = np.full(NUM_PERM, np.iinfo(np.uint32).max, np.uint64)
    for i in range(0, len(shingles), _CHUNK):
        hashed = (shingles[i:i + _CHUNK, None] * _PERM_A + _PERM_B) >> np.uint64(32)  # multiply-shift hashing
        np.minimum(sig, hashed.min(axis=0), out=sig)
    return sig.astype(np.uint32)


def lsh_bands(threshold: float) -> Tuple[int, int]:
    """(bands, rows per band) with bands x rows <= NUM_PERM: the most rows (fewest false candidates) that
    still make a pair at exactly `threshold` a candidate with probability >= 0.95."""
    for rows in range(NUM_PERM, 0, -1):
        bands = NUM_PERM // rows
        if 1 - (1 - threshold ** rows) ** bands >= 0.95:
            return bands, rows
    return NUM_PERM, 1


class NearDuplicateIndex:
    """Signatures of the documents kept so far, bucketed by LSH band."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.bands, self.rows = lsh_bands(threshold)
        self._buckets: List[Dict[bytes, List[int]]] = [defaultdict(list) for _ in range(self.bands)]
        self._kept: List[np.ndarray] = []

    def add_unless_duplicate(self, sig: np.ndarray) -> bool:
        """Keep `sig` and return True, unless a kept signature agrees on >= threshold of its entries."""
        keys = [sig[b * self.rows:(b + 1) * self.rows].tobytes() for b in range(self.bands)]
        candidates = {i for band, key in zip(self._buckets, keys) for i in band.get(key, ())}
        if any(np.mean(self._kept[i] == sig) >= self.threshold for i in candidates):
            return False
        for band, key in zip(self._buckets, keys):
            band[key].append(len(self._kept))
        self._kept.append(sig)
        return True
