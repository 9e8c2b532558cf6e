"""MinHash signatures of word 5-gram sets, and the LSH band keys that find candidate near duplicates among
them (data/dedup.py keeps the index).

Words are runs of letters/digits, lowercased; each CJK character is a word of its own (those scripts do not
separate words with spaces). The fraction of equal signature entries estimates the Jaccard similarity of
two documents' 5-gram sets (standard error about 0.04 at 0.8 with 128 permutations).
"""
from __future__ import annotations

import re
import zlib
from typing import Tuple

import numpy as np

from base.text import CJK

NUM_PERM = 128
SHINGLE_WORDS = 5
_WORD = re.compile(rf"[^\W_{CJK}]+|[{CJK}]")
_rng = np.random.default_rng(20240601)  # fixed: signatures must agree across processes and runs
_MIX = _rng.integers(1, 2**63, SHINGLE_WORDS, dtype=np.uint64) * 2 + 1  # odd multipliers, word hash -> 5-gram
_PERM_A = _rng.integers(1, 2**63, NUM_PERM, dtype=np.uint64) * 2 + 1
_PERM_B = _rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)
_BAND_SEED = _rng.integers(0, 2**63, NUM_PERM, dtype=np.uint64)  # per band: keys of different bands differ
_BAND_MUL = np.uint64(0x9E3779B97F4A7C15)  # odd: multiplying by it permutes the 64-bit values
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


def band_keys(signatures: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """uint64 [n, bands]: one key per LSH band of each signature (uint32 [n, NUM_PERM]). Equal bands give
    equal keys; bands that differ, or the same values in another band, collide with probability ~2^-64 (a
    collision only makes a candidate, which the signatures' agreement then rules out)."""
    sig = signatures[:, :bands * rows].astype(np.uint64).reshape(len(signatures), bands, rows)
    keys = np.broadcast_to(_BAND_SEED[:bands], (len(signatures), bands)).copy()
    for r in range(rows):
        keys = (keys ^ sig[:, :, r]) * _BAND_MUL  # multiply-xor, wrapping mod 2**64
        keys ^= keys >> np.uint64(29)
    return keys
