"""How long one training step of a layout takes: compute, collectives and the pipeline bubble. docs/planning.md
explains each term and the published runs that hold it (tests/test_time_published.py).

For one device of the busiest pipeline stage, with M micro-batches per step (the pipeline's micro-batches, or
gradient accumulation without pp):

    t_micro   = compute + tensor-parallel collectives + pipeline send/recv, for one micro-batch on one stage
    compute   = hardware FLOPs of the micro-batch / (tp x pp) / (peak of the compute dtype x compute_efficiency)
    step      = (M + pp - 1) x t_micro + the data-parallel reduction left after its overlap
    bubble    = (pp - 1) x t_micro: the 1F1B schedule's fill and drain (Narayanan et al. 2021, section 2.2;
                mindlab's pipeline is not interleaved, which would divide it by the virtual stages)

Hardware FLOPs are the family's model FLOPs per token (6N + attention), plus what recompute repeats: full
recompute a whole forward (+1/3), selective the attention core's forward. MFU counts model FLOPs only.

Collectives are rings: an all-reduce of S bytes over n ranks moves 2(n-1)/n x S per device, an all-gather or a
reduce-scatter (n-1)/n x S, at the bandwidth of the slowest link the group spans: inside a node when its ranks
(Megatron's order, planner/layout.py) fit in device.devices_per_node, else across nodes. Latency is ignored.
  * tensor parallel (Megatron-LM): per layer, 2 all-reduces of the [b, s, h] activation in the forward and 2 in
    the backward (all-gather + reduce-scatter pairs under sequence parallelism: the same bytes), 2 more when
    full recompute repeats the forward. On the critical path: nothing else runs while a layer waits for them.
  * pipeline parallel: per micro-batch and stage, the activation forward and its gradient backward, [b, s, h]
    (/ tp under sequence parallelism, which passes the sequence shards). On the critical path.
  * data parallel: once per step, the fp32 gradients of the device's parameters: an all-reduce, or under
    optimizer sharding a reduce-scatter and then an all-gather of the updated fp32 weights (the same bytes).
    Overlapped: the gradients' reduction with the last micro-batch's backward, the weights' all-gather with the
    first micro-batch's forward; only what exceeds them is added to the step.
Not counted: the optimizer update, the vocabulary-parallel embedding's and logits' collectives, a frozen
reference model's forward (DPO, PPO), stages of unequal cost (layers are split evenly; the head is ignored).
"""
from dataclasses import dataclass
from typing import Any, List, Tuple

from base.registry import FAMILIES
from planner.memory import DTYPE_BYTES, stage_parameters

GRAD_BYTES = 4  # mindlab accumulates and reduces gradients in fp32 (planner/memory.py)


@dataclass(frozen=True)
class Comm:
    """One kind of communication in a step, on one device."""
    kind: str  # tp | dp | pp
    collective: str  # what runs, e.g. "all-reduce x 320"
    bytes: float  # moved per device per step (ring volume)
    link: str  # intra-node | inter-node
    seconds: float  # at the link's bandwidth (0 when the device preset gives none)
    exposed: float  # of those, on the step's critical path


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


def link(device: Any, span: int) -> Tuple[str, float]:
    """(name, bytes/s) of the slowest link a group of `span` consecutive ranks crosses."""
    if span <= device.devices_per_node:
        return "intra-node", device.intra_node_gb_per_s * 1e9
    return "inter-node", device.inter_node_gb_per_s * 1e9


def hardware_flops_per_token(m: Any, seq_len: int, recompute: str) -> float:
    """Model FLOPs per token plus what recompute runs again (a forward is a third of the training FLOPs)."""
    fam = FAMILIES[m.family]
    model = fam.flops_per_token(m, seq_len)
    attention = model - 6 * fam.matmul_parameter_count(m)  # QK^T and PV, forward and backward
    return model + {"none": 0.0, "selective": attention / 3, "full": model / 3}[recompute]


def step_time(m: Any, p: Any, device: Any, seq_len: int, micro_batch_size: int, micro_batches: int,
              compute_dtype: str, recompute: str, sequences: float = 1.0) -> StepTime:
    """The step of layout `p` (dp, tp, pp, optimizer_shard, sequence_parallel) feeding `micro_batches` micro-batches
    of `micro_batch_size` samples through each data-parallel replica; `sequences`: sequences the trained model runs
    per sample (2 for a preference pair)."""
    peak = device.peak_tflops[compute_dtype] * 1e12
    tokens = micro_batch_size * sequences * seq_len  # one micro-batch of one replica
    compute = hardware_flops_per_token(m, seq_len, recompute) * tokens / (p.tp * p.pp) / (
        peak * device.compute_efficiency)
    activation = tokens * m.hidden_size * DTYPE_BYTES[compute_dtype]  # [b, s, h] in the compute dtype
    layers = m.num_layers // p.pp
    comms: List[Comm] = []

    def add(kind: str, collective: str, volume: float, span: int, window: float = 0.0) -> float:
        name, bandwidth = link(device, span)
        seconds = volume / bandwidth if bandwidth else 0.0
        comms.append(Comm(kind, collective, volume, name, seconds, max(0.0, seconds - window)))
        return seconds

    per_micro = compute
    if p.tp > 1:
        passes = 3 if recompute == "full" else 2
        count = 2 * passes * layers * micro_batches
        kind = "all-gather + reduce-scatter" if p.sequence_parallel else "all-reduce"
        per_micro += add("tp", f"{kind} x {count}", count * 2 * (p.tp - 1) / p.tp * activation, p.tp) / micro_batches
    experts = FAMILIES[m.family].experts
    if experts is not None and p.ep > 1:  # each token's top_k copies to their experts' ranks and back
        top_k, passes = experts(m)[1], 3 if recompute == "full" else 2
        count = 2 * passes * layers * micro_batches  # dispatch and combine, per forward and backward pass
        sent = count * top_k * (p.ep - 1) / p.ep * activation / (p.tp if p.sequence_parallel else 1)
        per_micro += add("ep", f"all-to-all x {count}", sent, p.ep * p.tp) / micro_batches
    if p.pp > 1:
        message = activation / (p.tp if p.sequence_parallel else 1)
        per_micro += add("pp", f"send/recv x {2 * micro_batches}", 2 * micro_batches * message,
                         p.dp * p.tp * p.pp) / micro_batches
    if p.dp > 1:
        grads = max(stage_parameters(m, p)) * GRAD_BYTES
        ring = (p.dp - 1) / p.dp * grads
        span, backward, forward = p.dp * p.tp, 2 / 3 * compute, 1 / 3 * compute
        if p.optimizer_shard:
            add("dp", "reduce-scatter (gradients)", ring, span, backward)
            add("dp", "all-gather (weights)", ring, span, forward)
        else:
            add("dp", "all-reduce (gradients)", 2 * ring, span, backward)
    bubble = (p.pp - 1) * per_micro
    step = micro_batches * per_micro + bubble + sum(c.exposed for c in comms if c.kind == "dp")
    return StepTime(
        compute=micro_batches * compute, bubble=bubble, comms=tuple(comms), step=step,
        tokens_per_step=int(micro_batches * micro_batch_size * seq_len * p.dp),
        devices=p.dp * p.tp * p.pp, model_flops_per_token=FAMILIES[m.family].flops_per_token(m, seq_len) * sequences,
        peak_tflops=device.peak_tflops[compute_dtype],
        links_known=bool(device.intra_node_gb_per_s and (device.inter_node_gb_per_s or
                                                         p.dp * p.tp * p.pp <= device.devices_per_node)))


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
                    f"{c.seconds:.3g} s" + (f" ({c.exposed:.3g} s not overlapped)" if c.kind == "dp" else ""))
    return "\n".join(rows)
