"""Context parallelism: how a sequence is split over the cp ranks, and ring attention written out in NumPy as the
reference the time and memory models describe (tests/test_context_parallel.py holds it equal to full causal
attention, forward and backward).

Load-balanced causal chunks (Megatron-LM's context parallelism, MindFormers' colossalai_cp): the sequence is cut into
2 x cp chunks and rank i holds chunks i and 2cp-1-i, so under the causal mask every rank does the same work (an
early chunk sees little, its late partner sees much).

Ring attention (Liu et al. 2023): each rank keeps its queries; the key/value blocks travel around the cp ranks in
cp - 1 send/recv steps, and each rank merges the partial attention of every block with the online softmax (a running
row maximum, the normaliser and the weighted values, rescaled when the maximum grows: the flash attention merge).
The backward sends the blocks around again with their gradients dK, dV, which arrive back at their owner after the
last step. Each step's transfer overlaps with the attention of the block in hand (planner/timing.py).

Ulysses (DeepSpeed): an all-to-all turns the sequence shards of Q, K, V into head shards of the whole sequence,
attention runs unsplit, and a second all-to-all turns the output back. Hybrid: Ulysses over the cp ranks inside a
node (base.schema.ulysses_degree), the ring over the rest.
"""
from typing import List, Tuple

import numpy as np


def chunk_order(seq_len: int, cp: int) -> List[np.ndarray]:
    """The positions each cp rank holds: chunks i and 2cp-1-i of 2 x cp equal chunks."""
    chunks = np.split(np.arange(seq_len), 2 * cp)
    return [np.concatenate([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)]


def _block(q: np.ndarray, k: np.ndarray, qpos: np.ndarray, kpos: np.ndarray, scale: float) -> np.ndarray:
    """Causally masked scores of a query block against a key block, by their global positions."""
    scores = q @ k.T * scale
    return np.where(kpos[None, :] <= qpos[:, None], scores, -np.inf)


def ring_forward(q: np.ndarray, k: np.ndarray, v: np.ndarray, cp: int) -> Tuple[np.ndarray, np.ndarray]:
    """Causal attention of one head, [S, d] inputs, as cp ranks compute it with ring attention; returns the output
    and the per-row log-sum-exp (what the backward keeps), both in sequence order."""
    positions = chunk_order(len(q), cp)
    scale = 1 / np.sqrt(q.shape[1])
    out, lse = np.zeros_like(q), np.zeros(len(q))
    for rank, qpos in enumerate(positions):
        row_max = np.full(len(qpos), -np.inf)
        norm, acc = np.zeros(len(qpos)), np.zeros((len(qpos), v.shape[1]))
        for step in range(cp):  # the block of rank - step arrives at step `step`
            kpos = positions[(rank - step) % cp]
            scores = _block(q[qpos], k[kpos], qpos, kpos, scale)
            new_max = np.maximum(row_max, scores.max(axis=1))
            seen = np.isfinite(new_max)
            rescale = np.where(seen, np.exp(row_max - np.where(seen, new_max, 0)), 0.0)
            p = np.where(seen[:, None], np.exp(scores - np.where(seen, new_max, 0)[:, None]), 0.0)
            norm = norm * rescale + p.sum(axis=1)
            acc = acc * rescale[:, None] + p @ v[kpos]
            row_max = new_max
        out[qpos] = acc / norm[:, None]
        lse[qpos] = row_max + np.log(norm)
    return out, lse


def ring_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray, lse: np.ndarray,
                  grad_out: np.ndarray, cp: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """dQ, dK, dV of ring_forward: each rank recomputes the probabilities of every block it meets from the kept
    log-sum-exp; dQ stays with the queries, dK and dV travel with their block back to its owner."""
    positions = chunk_order(len(q), cp)
    scale = 1 / np.sqrt(q.shape[1])
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for rank, qpos in enumerate(positions):
        delta = (grad_out[qpos] * out[qpos]).sum(axis=1)  # rowsum(dO * O)
        for step in range(cp):
            kpos = positions[(rank - step) % cp]
            p = np.exp(_block(q[qpos], k[kpos], qpos, kpos, scale) - lse[qpos][:, None])
            dv[kpos] += p.T @ grad_out[qpos]
            ds = p * (grad_out[qpos] @ v[kpos].T - delta[:, None])
            dq[qpos] += ds @ k[kpos] * scale
            dk[kpos] += ds.T @ q[qpos] * scale
    return dq, dk, dv
