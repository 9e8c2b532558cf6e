"""Ring attention over load-balanced causal chunks (planner/context_parallel.py) against full causal attention:
torch's scaled_dot_product_attention and its autograd are the reference, forward and backward."""
import numpy as np
import pytest
import torch

from planner.context_parallel import chunk_order, ring_backward, ring_forward


def reference(q, k, v, grad_out):
    q, k, v = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
    out.backward(torch.tensor(grad_out))
    return out.detach().numpy(), q.grad.numpy(), k.grad.numpy(), v.grad.numpy()


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_ring_attention_equals_full_causal_attention(cp):
    rng = np.random.default_rng(cp)
    q, k, v, grad_out = (rng.standard_normal((32, 8)) for _ in range(4))
    out, lse = ring_forward(q, k, v, cp)
    grads = ring_backward(q, k, v, out, lse, grad_out, cp)
    want_out, *want_grads = reference(q, k, v, grad_out)
    np.testing.assert_allclose(out, want_out, rtol=1e-10, atol=1e-12)
    for got, want in zip(grads, want_grads):
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-11)


def test_load_balanced_chunks_give_every_rank_the_same_causal_work():
    """Rank i holds chunks i and 2cp-1-i: every position once, and the same count of unmasked scores per rank."""
    seq_len, cp = 64, 4
    held = chunk_order(seq_len, cp)
    assert sorted(np.concatenate(held).tolist()) == list(range(seq_len))
    work = [int((pos + 1).sum()) for pos in held]  # row p attends to p + 1 keys
    assert work == [work[0]] * cp == [seq_len * (seq_len + 1) // 2 // cp] * cp
