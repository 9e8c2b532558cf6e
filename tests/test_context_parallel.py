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


# --- the planner's terms for cp, interleave, ZeRO-3, tp overlap and rails, by hand --------------------------------

from types import SimpleNamespace  # noqa: E402

from conftest import compose_cfg  # noqa: E402
from planner.advisor import Candidate  # noqa: E402
from planner.launch import mindformers_parallel_config  # noqa: E402
from planner.layout import Layout  # noqa: E402
from planner.memory import memory_plan  # noqa: E402
from planner.timing import link, step_time  # noqa: E402


@pytest.fixture(scope="module")
def seven_b():
    cfg = compose_cfg("model=7b", "device=ascend910b")
    return cfg.model, cfg.device


def test_rank_order_puts_cp_between_tp_and_dp():
    """Megatron's tp-cp-dp-pp: rank = ((pp * dp + d) * cp + c) * tp + t."""
    layout = Layout(dp=2, tp=2, pp=2, num_layers=8, cp=2)
    assert layout.cp_groups()[:2] == [[0, 2], [1, 3]] and layout.dp_groups()[0] == [0, 4]
    assert layout.pp_groups()[0] == [0, 8] and all(layout.rank(*layout.coords(r)[:3], layout.coords(r).cp) == r
                                                   for r in range(16))


def test_a_group_crossing_nodes_rides_the_rails_of_its_ranks_on_a_node(seven_b):
    """8 NICs of 25 GB/s a node: dp of tp 1 (8 ranks a node) gets all 8, of tp 2 four, of tp 8 one; never more than
    the 196 GB/s inside the node."""
    _, device = seven_b
    for tp, rails in ((8, 1), (2, 4)):
        span = Layout(dp=32 // tp, tp=tp, pp=1, num_layers=32).span("dp", 8)
        assert link(device, span) == ((f"inter-node ({rails:g} rails)" if rails != 1 else "inter-node"), 25e9 * rails)
    assert link(device, Layout(dp=32, tp=1, pp=1, num_layers=32).span("dp", 8))[1] == 196e9


def test_cp_divides_the_activations_and_logits_and_zero3_the_gradients(seven_b):
    m, _ = seven_b
    base = dict(dp=2, tp=1, pp=1, micro_batches=1, optimizer_shard=True, sequence_parallel=False, cp=1, vp=1,
                zero3=False)
    one = memory_plan(m, SimpleNamespace(**base), 8192, 1, "bf16", "none", True)
    four = memory_plan(m, SimpleNamespace(**{**base, "cp": 4, "zero3": True}), 8192, 1, "bf16", "none", True)
    assert four.activations == pytest.approx(one.activations / 4) and four.logits == pytest.approx(one.logits / 4)
    assert four.weights == pytest.approx(one.weights / 4)  # sharded over dp x cp = 8 instead of 2
    assert four.grads == pytest.approx(one.grads / 8)  # zero3: over dp x cp


def test_interleaving_divides_the_bubble_and_adds_to_the_first_stages_activations(seven_b):
    m, device = seven_b
    base = dict(dp=1, tp=1, pp=4, micro_batches=8, optimizer_shard=False, sequence_parallel=False, cp=1, vp=1,
                zero3=False, tp_overlap=False, cp_algo="ring")
    plain, interleaved = (SimpleNamespace(**{**base, "vp": v}) for v in (1, 2))
    t1, t2 = (step_time(m, p, device, 4096, 1, 8, "bf16", "none") for p in (plain, interleaved))
    assert t2.compute == pytest.approx(t1.compute)
    assert t2.bubble / t2.step < t1.bubble / t1.step and t2.bubble == pytest.approx(
        3 / 2 * (t2.step - t2.bubble) / 8, rel=1e-9)  # (pp - 1) / vp of a micro-batch
    m1, m2 = (memory_plan(m, p, 4096, 1, "bf16", "none", True) for p in (plain, interleaved))
    assert m2.activations == pytest.approx(m1.activations * (1 + 3 / 8))  # 1 + (pp - 1) / (pp vp)


def test_the_ring_sends_kv_blocks_hidden_under_attention(seven_b):
    """cp 4 ring at 32k: 3 steps of this rank's K and V ([s/4, kv heads x 128] in bf16) per layer, forward once and
    backward twice, 32 layers; inside one node (tp 1 x cp 4 <= 8)."""
    m, device = seven_b
    p = SimpleNamespace(dp=1, tp=1, pp=1, micro_batches=1, optimizer_shard=False, sequence_parallel=False, cp=4,
                        vp=1, zero3=False, tp_overlap=False, cp_algo="ring")
    t = step_time(m, p, device, 32768, 1, 1, "bf16", "none")
    (cp,) = [c for c in t.comms if c.kind == "cp"]
    block = 2 * 32768 / 4 * 32 * 128 * 2  # K and V of this rank
    assert cp.bytes == pytest.approx(3 * 3 * 32 * block) and cp.link == "intra-node"
    assert cp.seconds == pytest.approx(cp.bytes / 196e9) and cp.exposed == 0.0  # the attention core takes longer
    assert t.compute == pytest.approx(step_time(m, SimpleNamespace(**{**vars(p), "cp": 1}), device, 32768, 1, 1,
                                                "bf16", "none").compute / 4)


def test_tp_overlap_hides_the_collectives_under_the_matmuls(seven_b):
    m, device = seven_b
    p = SimpleNamespace(dp=1, tp=8, pp=1, micro_batches=1, optimizer_shard=False, sequence_parallel=True, cp=1,
                        vp=1, zero3=False, tp_overlap=False, cp_algo="ring")
    exposed, hidden = (step_time(m, SimpleNamespace(**{**vars(p), "tp_overlap": o}), device, 4096, 1, 1, "bf16",
                                 "none") for o in (False, True))
    assert exposed.step - hidden.step == pytest.approx(exposed.comms[0].seconds)  # all of it: the matmuls take longer


def test_the_mindformers_config_of_cp_interleave_zero3_and_overlap():
    c = Candidate(1, 4, 2, True, True, "full", 1, 16, cp=4, cp_algo="hybrid", vp=2, zero3=True, tp_overlap=True)
    text = mindformers_parallel_config(c, "bf16", 8)
    for line in ("context_parallel: 4", "context_parallel_algo: hybrid_cp", "ulysses_degree_in_cp: 2",
                 "optimizer_level: level3", "pipeline_interleave: True", "pp_interleave_num: 2",
                 "fine_grain_interleave: 2"):
        assert line in text
