"""How long one training step of a layout takes: compute, collectives and the pipeline bubble. docs/planning.md
explains each term and the published runs that hold it (tests/test_time_published.py).

For one device of the busiest pipeline stage, with M micro-batches per step (the pipeline's micro-batches, or
gradient accumulation without pp):

    t_micro   = compute + the exposed tensor- and context-parallel traffic + pipeline send/recv, for one
                micro-batch on one stage
    compute   = hardware FLOPs of the micro-batch / (tp x cp x pp) / (peak of the compute dtype x compute_efficiency)
    step      = M x t_micro + bubble + the data-parallel reduction left after its overlap
    bubble    = (pp - 1) / vp x t_micro: the 1F1B schedule's fill and drain, shortened vp times by the interleaved
                schedule's virtual stages (Narayanan et al. 2021, sections 2.2.1-2.2.2)

Hardware FLOPs are the family's model FLOPs per token (6N + attention), plus what recompute repeats: full
recompute a whole forward (+1/3), selective the attention core's forward. MFU counts model FLOPs only. Attention
without a flash kernel also moves its [a, s, s] scores through the device's memory (score_traffic), which at 2K
tokens and a small hidden size costs as much as a quarter of the matmuls' time.

Collectives are rings: an all-reduce of S bytes over n ranks moves 2(n-1)/n x S per device, an all-gather or a
reduce-scatter (n-1)/n x S, at the bandwidth of the slowest link the group spans: inside a node when its ranks
(Megatron's order, planner/layout.py) fit in device.devices_per_node, else across nodes over the rails the group
can use (`link`: a dp group with 8 ranks on each node rides all 8 NICs, one with 1 rank per node one NIC). Latency
is ignored.
  * tensor parallel (Megatron-LM): per layer, 2 all-reduces of the [b, s, h] activation in the forward and 2 in
    the backward (all-gather + reduce-scatter pairs under sequence parallelism: the same bytes), 2 more when
    full recompute repeats the forward. On the critical path: nothing else runs while a layer waits for them,
    unless tp_overlap (MindFormers' fine_grain_interleave, Megatron's --tp-comm-overlap) hides them under the
    matmuls: then only what exceeds the matmuls' time is exposed. A mixture of experts' feed-forward (the family's
    `experts`) moves its routed rows instead, top_k per token (an all-gather of the dispatched rows to the ranks
    holding each expert's width slice and the reduction of their partial sums: models/moe/plan.py), exposed even
    under tp_overlap: the overlap MindFormers' fine_grain_interleave gives is built for a dense FFN
    (mindformers/models/llama/llama_interleave.py has no MoE layer) and Megatron's --tp-comm-overlap covers the
    linear layers, not the MoE token dispatcher's gathers; a shared expert's collectives are a dense FFN's.
  * expert parallel: per layer and pass, the all-to-alls that send each token's top_k copies to their experts'
    ranks and bring them back (dispatch and combine), on the critical path.
  * context parallel: the ring's K/V blocks (overlapped with the attention of the block in hand) or Ulysses'
    all-to-alls (exposed), per layer and pass (_context_parallel). Each rank computes s / cp of every sequence.
  * pipeline parallel: per micro-batch and stage, the activation forward and its gradient backward, [b, s, h]
    (/ tp under sequence parallelism, which passes the sequence shards). On the critical path.
  * data parallel (over dp x cp: the cp ranks hold the same weights): once per step, the fp32 gradients of the
    device's parameters: an all-reduce, or under optimizer sharding a reduce-scatter and then an all-gather of the
    updated fp32 weights (the same bytes). Overlapped: the gradients' reduction with the last micro-batch's
    backward, the weights' all-gather with the first micro-batch's forward; only what exceeds them is added to
    the step. zero3 gathers the weights for every micro-batch's forward and backward instead (prefetched under
    the step's compute).
Not counted: the optimizer update, the vocabulary-parallel embedding's and logits' collectives, a frozen
reference model's forward (DPO, PPO), stages of unequal cost (layers are split evenly; the head is ignored).
"""
from dataclasses import dataclass
from typing import Any, Callable, List, Tuple

from base.registry import FAMILIES
from base.schema import ulysses_degree
from planner.layout import Layout, Span
from planner.memory import DTYPE_BYTES, stage_parameters

GRAD_BYTES = 4  # mindlab accumulates and reduces gradients in fp32 (planner/memory.py)


@dataclass(frozen=True)
class Comm:
    """One kind of communication in a step, on one device."""
    kind: str  # tp | cp | dp | pp
    collective: str  # what runs, e.g. "all-reduce x 320"
    bytes: float  # moved per device per step (ring volume)
    link: str  # intra-node | inter-node
    seconds: float  # at the link's bandwidth (0 when the device preset gives none)
    exposed: float  # of those, on the step's critical path (tp, cp, pp: per micro-batch; dp: per step)


@dataclass(frozen=True)
class StepTime:
    compute: float  # seconds of compute per step on one device (all micro-batches, no bubble)
    bubble: float  # seconds the device idles in the pipeline's fill and drain
    comms: Tuple[Comm, ...]
    step: float  # seconds per optimizer step
    tokens_per_step: int  # over all devices
    devices: int
    model_flops_per_token: float  # per token of a sample (a preference pair's tokens count twice)
    peak_tflops: float  # of the compute dtype
    links_known: bool  # whether the device preset gives its link bandwidths

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_step / self.step / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops_per_token * self.tokens_per_s_per_device / (self.peak_tflops * 1e12)

    @property
    def bubble_fraction(self) -> float:
        return self.bubble / self.step


def link(device: Any, span: Span) -> Tuple[str, float]:
    """(name, bytes/s) of the slowest link a group crosses. Across nodes its ring runs over the rails it can use:
    nics_per_node x (its ranks on a node) / devices_per_node NICs, the node's other groups, busy at the same time,
    taking the rest (NCCL and HCCL build a ring per rail); never faster than the links inside a node."""
    if not span.crosses_nodes:
        return "intra-node", device.intra_node_gb_per_s * 1e9
    nics = device.nics_per_node or device.devices_per_node
    rails = nics * span.per_node / device.devices_per_node
    bandwidth = device.inter_node_gb_per_s * 1e9 * rails
    if device.intra_node_gb_per_s:
        bandwidth = min(bandwidth, device.intra_node_gb_per_s * 1e9)
    return f"inter-node ({rails:g} rails)" if rails != 1 else "inter-node", bandwidth


def hardware_flops_per_token(m: Any, seq_len: int, recompute: str) -> float:
    """Model FLOPs per token plus what recompute runs again (a forward is a third of the training FLOPs)."""
    fam = FAMILIES[m.family]
    model = fam.flops_per_token(m, seq_len)
    attention = model - 6 * fam.matmul_parameter_count(m)  # QK^T and PV, forward and backward
    return model + {"none": 0.0, "selective": attention / 3, "full": model / 3}[recompute]


def step_time(m: Any, p: Any, device: Any, seq_len: int, micro_batch_size: int, micro_batches: int,
              compute_dtype: str, recompute: str, sequences: float = 1.0, plain_attention: bool = False) -> StepTime:
    """The step of layout `p` (dp, tp, cp, pp, vp and the flags of base/schema.py's ParallelConfig) feeding
    `micro_batches` micro-batches of `micro_batch_size` samples through each data-parallel replica; `sequences`:
    sequences the trained model runs per sample (2 for a preference pair); `plain_attention`: the attention
    materialises its scores (no flash kernel), whose memory traffic is added (score_traffic)."""
    peak = device.peak_tflops[compute_dtype] * 1e12
    tokens = micro_batch_size * sequences * seq_len  # one micro-batch of one replica
    flops = hardware_flops_per_token(m, seq_len, recompute)
    fam = FAMILIES[m.family]
    rate = peak * device.compute_efficiency
    shard = p.tp * p.cp * p.pp
    compute = flops * tokens / shard / rate
    if plain_attention:
        compute += score_traffic(m, p, device, seq_len, micro_batch_size * sequences, recompute, compute_dtype)
    dense = 6 * fam.matmul_parameter_count(m) * tokens / shard / rate  # the matmuls' part (tp overlap hides under it)
    attention_core = (fam.flops_per_token(m, seq_len) - 6 * fam.matmul_parameter_count(m)) * tokens / shard / rate
    activation = tokens / p.cp * m.hidden_size * DTYPE_BYTES[compute_dtype]  # this rank's [b, s/cp, h]
    grid = Layout(dp=p.dp, tp=p.tp, pp=p.pp, num_layers=m.num_layers, cp=p.cp, vp=p.vp, ep=p.ep)
    layers = m.num_layers // p.pp
    passes = 3 if recompute == "full" else 2  # forward, backward, and the recomputed forward
    comms: List[Comm] = []

    def add(kind: str, collective: str, volume: float, span: Span, window: float = 0.0) -> float:
        name, bandwidth = link(device, span)
        seconds = volume / bandwidth if bandwidth else 0.0
        exposed = max(0.0, seconds - window)
        comms.append(Comm(kind, collective, volume, name, seconds, exposed))
        return exposed

    per_micro = compute
    experts = fam.experts
    top_k = experts(m)[1] if experts is not None else 0
    if p.tp > 1:
        per_micro += _tensor_parallel(m, p, grid, device, activation, top_k, layers * passes, micro_batches,
                                      micro_batches * dense, add) / micro_batches
    if p.cp > 1:
        per_micro += _context_parallel(m, p, grid, device, tokens, layers, passes, micro_batches, attention_core,
                                       compute_dtype, add) / micro_batches
    if top_k and p.ep > 1:  # each token's top_k copies to their experts' ranks and back
        count = 2 * passes * layers * micro_batches  # dispatch and combine, per forward and backward pass
        sent = count * top_k * (p.ep - 1) / p.ep * activation / (p.tp if p.sequence_parallel else 1)
        per_micro += add("ep", f"all-to-all x {count}", sent, grid.span("ep", device.devices_per_node)) / micro_batches
    if p.pp > 1:
        message = activation / (p.tp if p.sequence_parallel else 1)
        sends = 2 * micro_batches * p.vp
        per_micro += add("pp", f"send/recv x {sends}", sends * message,
                         grid.span("pp", device.devices_per_node)) / micro_batches
    reduce_span = grid.span("dpcp", device.devices_per_node)
    if p.dp * p.cp > 1:
        grads = max(stage_parameters(m, p)) * GRAD_BYTES
        n = p.dp * p.cp
        ring = (n - 1) / n * grads
        backward, forward = 2 / 3 * compute, 1 / 3 * compute
        if p.zero3:  # the weights gathered for every micro-batch's forward and backward, prefetched under the
            # step's compute that the gradients' reduce-scatter (under the last backward) leaves to them
            scatter = add("dp", "reduce-scatter (gradients)", ring, reduce_span, backward)
            busy = comms[-1].seconds - scatter
            add("dp", f"all-gather (weights) x {2 * micro_batches}", 2 * micro_batches * ring, reduce_span,
                max(0.0, micro_batches * compute - busy))
        elif p.optimizer_shard:
            add("dp", "reduce-scatter (gradients)", ring, reduce_span, backward)
            add("dp", "all-gather (weights)", ring, reduce_span, forward)
        else:
            add("dp", "all-reduce (gradients)", 2 * ring, reduce_span, backward)
    bubble = (p.pp - 1) / p.vp * per_micro
    step = micro_batches * per_micro + bubble + sum(c.exposed for c in comms if c.kind == "dp")
    devices = p.dp * p.tp * p.cp * p.pp
    return StepTime(
        compute=micro_batches * compute, bubble=bubble, comms=tuple(comms), step=step,
        tokens_per_step=int(micro_batches * micro_batch_size * seq_len * p.dp),
        devices=devices, model_flops_per_token=fam.flops_per_token(m, seq_len) * sequences,
        peak_tflops=device.peak_tflops[compute_dtype],
        links_known=bool(device.intra_node_gb_per_s and (device.inter_node_gb_per_s or
                                                         devices <= device.devices_per_node)))


SCORE_PASSES = 11  # reads and writes of the [a, s, s] scores in a forward and backward (see score_traffic)


def score_traffic(m: Any, p: Any, device: Any, seq_len: int, samples: float, recompute: str,
                  compute_dtype: str) -> float:
    """Seconds one device of a stage spends moving plain attention's scores through its memory, per micro-batch:
    the [a/tp, s, s/cp] scores of each layer are written by QK^T, read and written by the softmax and read by PV in
    the forward (4 passes), and in the backward read for dV, dP written, read with P by the softmax's gradient,
    dS written and read for dQ and dK (7): SCORE_PASSES, 4 more when full recompute repeats the forward. Memory
    bound: elementwise at device.hbm_gb_per_s (0: unknown, not counted). Flash attention keeps the scores on
    chip, and the matmul FLOPs stay in the compute term either way."""
    if not device.hbm_gb_per_s:
        return 0.0
    passes = SCORE_PASSES + (4 if recompute == "full" else 0)
    scores = m.num_heads / p.tp * seq_len * seq_len / p.cp * samples * (m.num_layers // p.pp)
    return passes * scores * DTYPE_BYTES[compute_dtype] / (device.hbm_gb_per_s * 1e9)


def _tensor_parallel(m: Any, p: Any, grid: Layout, device: Any, activation: float, top_k: int, layer_passes: int,
                     micro_batches: int, matmuls: float, add: Callable) -> float:
    """The tp group's traffic for all micro-batches, and what of it is exposed: per layer and pass, the attention's
    and the dense (or shared-expert) feed-forward's collectives over this rank's activation, hidden under the
    matmuls (`matmuls` seconds) with tp_overlap; a mixture of experts' routed rows, top_k per token, move between
    the dispatch and the combine, which no tp overlap covers."""
    kind = "all-gather + reduce-scatter" if p.sequence_parallel else "all-reduce"
    ring = 2 * (p.tp - 1) / p.tp * activation
    span = grid.span("tp", device.devices_per_node)
    blocks = 1 + (1 if not top_k or getattr(m, "shared_expert_intermediate_size", 0) else 0)
    count = blocks * layer_passes * micro_batches
    overlap = " (overlapped with the matmuls)" if p.tp_overlap else ""
    exposed = add("tp", f"{kind} x {count}{overlap}", count * ring, span, matmuls if p.tp_overlap else 0.0)
    if top_k:
        count = layer_passes * micro_batches
        exposed += add("tp", f"{kind} x {count} (the experts' rows, x {top_k})", count * top_k * ring, span)
    return exposed


def _context_parallel(m: Any, p: Any, grid: Layout, device: Any, tokens: float, layers: int, passes: int,
                      micro_batches: int, attention_core: float, compute_dtype: str, add: Callable) -> float:
    """The cp group's traffic for all micro-batches, and what of it is exposed (planner/context_parallel.py).

    Ring: per layer and pass, cp_ring - 1 send/recv steps of this rank's K and V block ([b, s/cp, kv/tp] each),
    twice in the backward (the blocks and their gradients); each step overlaps with the attention of the block in
    hand, so only what exceeds the attention core's time is exposed. Ulysses: per layer and pass, all-to-alls of
    Q, K, V in and the output back over its u ranks ((u-1)/u of the bytes leave each rank), on the critical path.
    Hybrid: Ulysses over the cp ranks inside a node, the ring over the rest (of the same block size)."""
    per_node = device.devices_per_node
    u = ulysses_degree(p.cp, p.cp_algo, p.tp, per_node)
    ring_ranks = p.cp // u
    head_dim = m.hidden_size // m.num_heads
    width = DTYPE_BYTES[compute_dtype] * tokens / p.cp / p.tp * head_dim  # bytes per head of this rank's shard
    exposed = 0.0
    if u > 1:
        span = Layout(dp=1, tp=p.tp, pp=1, num_layers=1, cp=u).span("cp", per_node)
        volume = (u - 1) / u * 2 * (m.num_heads + m.num_kv_heads) * width  # Q, K, V in; the output back
        count = 4 * passes * layers * micro_batches
        exposed += add("cp", f"all-to-all x {count} (Ulysses over {u})", count / 4 * volume, span)
    if ring_ranks > 1:
        stride_cp = Layout(dp=1, tp=p.tp * u, pp=1, num_layers=1, cp=ring_ranks)
        span = stride_cp.span("cp", per_node)
        block = 2 * m.num_kv_heads * width  # K and V
        steps = (ring_ranks - 1) * (passes + 1) * layers * micro_batches  # the backward passes twice the bytes
        window = micro_batches * attention_core * (ring_ranks - 1) / ring_ranks
        exposed += add("cp", f"ring send/recv x {steps} (K/V blocks over {ring_ranks})", steps * block, span, window)
    return exposed


def format_time(t: StepTime, device: Any, compute_dtype: str) -> str:
    """The step's time by part and its communication by kind, as the dry run prints them."""
    rows = [f"time per step (predicted): {t.step:.3g} s = compute {t.compute:.3g} s at "
            f"{device.compute_efficiency:.0%} of {t.peak_tflops:g} TFLOP/s ({compute_dtype}, device.compute_efficiency)"
            f" + pipeline bubble {t.bubble:.3g} s ({t.bubble_fraction:.0%}) + communication on the critical path "
            f"{sum(c.exposed for c in t.comms):.3g} s",
            f"  {t.tokens_per_s_per_device:,.0f} tokens/s per device, MFU {t.mfu:.0%} "
            f"({t.tokens_per_step:,} tokens per step on {t.devices} devices)"]
    if not t.links_known:
        rows.append(f"  communication time unknown: device {device.name} gives no link bandwidth "
                    "(device.intra_node_gb_per_s / inter_node_gb_per_s)")
    for c in t.comms:
        gib = c.bytes / 2 ** 30
        rows.append(f"  {c.kind} {c.collective}: {gib:,.0f}" if gib >= 100 else f"  {c.kind} {c.collective}: {gib:.3g}")
        rows[-1] += (f" GiB per device over {c.link} links, "
                    f"{c.seconds:.3g} s" + (f" ({c.exposed:.3g} s not overlapped)" if c.exposed < c.seconds else ""))
    return "\n".join(rows)
