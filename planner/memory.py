"""Per-device memory plan for training a model family under a dp x tp x cp x pp layout. The family says what a
device holds (`stage_parameters`) and what a layer keeps for its backward (`layer_activation_factors`, in
models/<family>/accounting.py); the rules below are written out for the Llama decoder.

Conventions (bytes per device):
  * Parameters on a device: its pipeline stage's L/pp layers with every matmul weight split over tp
    (norm weights replicated), plus the vocab-parallel embedding (first stage) and lm head and final norm
    (last stage), each / tp. A tied head is a second copy on the last stage when pp > 1. Every stage is
    planned and the one with the largest total is reported. base/validate.py checks that tp divides the
    heads, KV heads, ffn width and vocabulary, so every shard is exact.
  * Weights: fp32 master weights, 4 B/param (mindlab keeps fp32 params and casts to the compute dtype
    inside the matmuls), divided by dp when optimizer_shard: MindSpore's optimizer parallel (semi-auto,
    distributed/semi_auto.py) stores each parameter as its dp slice and all-gathers it in the forward
    (the transient gathered copy is not counted).
    The weights repeat on every rank of the dp x cp group (context parallelism splits the sequence, not the
    weights), so sharding divides by dp x cp (Megatron's dp-cp group; MindSpore's optimizer parallel shards over
    all ranks holding the same slice).
  * Grads: accumulated in fp32, 4 B/param; divided by dp x cp under zero3 (ZeRO-3 / FSDP: MindSpore's
    optimizer_level level3, each rank keeps the reduce-scattered slice of the gradients).
  * Optimizer: AdamW m and v in fp32, 8 B/param, divided by dp when optimizer_shard.
  * Activations: Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
    Models", section 4, adapted to this decoder rather than taken as an estimate: its 34*s*b*h +
    5*a*s^2*b bytes per layer describe a GPT block (GeLU MLP, dropout). Without dropout (no 1-byte
    masks, no dropout outputs) a layer keeps, in elements per s*b*h,
        4              both norm inputs, the attention input and the MLP input (the norm outputs)
        2 + 2*kv/a     Q, K, V (K and V narrower under GQA) and the attention output
        4*f/h          SwiGLU gate, up, silu(gate) and their product (the down-projection input)
        a*s/h          the softmax output, a x s x s per sample
    (GPT in the same units: 5 + 4 + 8 with masks at half an element, and 2.5*a*s/h; Llama-2 7B has
    4 + 4 + 10.75.) Bytes = elements x the compute dtype's size, assuming every kept tensor has that
    width; with no 1-byte masks, fp32 is then exactly x2 of bf16 (if the residual stream and norms stay
    fp32 under bf16 compute, the 4 norm-side elements cost 4 B each and this undercounts).
    With tp = t the attention and MLP terms are / t while the 4 stay replicated; sequence parallelism
    splits those too, so everything is / t. Selective recompute and flash attention drop the a*s/h term
    (flash's per-row logsumexp is ignored; the same for the CPU fused kernel, the family's attention_kind). Full recompute keeps only each layer's input (1 element,
    / t under sequence parallelism) plus, in the backward, one layer's activations being recomputed.
    This is what a layer has to keep; an eager implementation keeps more. models/llama/model.py, under bf16,
    keeps its residual stream and RMSNorm in fp32, the softmax in fp32 plus its bf16 copy, and K, V
    repeated to all heads under GQA: read the activations as a lower bound for it.
  * Context parallelism: every activation and the logits are / cp (each rank holds s / cp of each sequence;
    Ulysses' heads-split attention core holds all of s for a / cp of the heads: the same bytes). The ring's
    K/V blocks in flight (two, double-buffered) are not counted: 2 x 2 x s/cp x kv x head_dim per layer, under 1%.
  * Pipeline (1F1B): stage i holds min(pp - i, micro_batches) micro-batches in flight, so the first
    stage holds the most. Interleaved (vp virtual stages): the first stage holds 1 + (pp - 1) / (pp x vp) times
    as much (Narayanan et al. 2021, section 2.2.2: the warm-up runs further ahead).
  * Logits: the last stage holds one micro-batch of fp32 logits, s*b*V/t*4 bytes (vocab-parallel).
  * The objective (its optional `memory(cfg)`, objectives/__init__.py) says what it changes: how many
    sequences the trained model runs per micro-batch sample (a preference pair is 2), how many fp32
    [tokens, vocab] arrays it keeps (DPO keeps the policy's and the reference's log-probabilities, the
    reward model none), parameters the trained model gains or loses against the causal LM (the reward model
    drops the LM head for a score row), and what it holds besides the trained model: frozen models (DPO's and
    PPO's reference, PPO's reward model: fp32 weights, no grads or optimizer states) and PPO's rollout cache.
Not counted: framework workspace, communication buffers, allocator fragmentation, the embedding output. What
fits is decided with headroom for them (`fits`): the plan plus FRAGMENTATION must stay within the device's memory
less what its runtime reserves (device.reserved_gb).

tests/test_memory_published.py holds this plan against published figures: Korthikanti et al.'s Table 2 (all
six rows, for their 22B/175B/530B/1T GPT shapes) less exactly the dropout tensors (2*s*b*h bytes of masks,
3*a*s^2*b in attention), their 1F1B first-stage total (Eq. 6) and 4*s*b*V/t fp32 logits; ZeRO's 16 B/param
(7.5B -> 120 GB) and its P_os 31.4 GB at Nd = 64 (weights and AdamW states sharded, grads not: 4 + 12/Nd);
Megatron-LM's theoretical_memory_usage.py parameter counts (equal), 18 B/param (2 more: its bf16 copy) and
s*b*h*(18 + 4*f/h)/t bytes per layer (4*f/h + 4*kv/a - 6 fewer: GeLU width, MHA, dropout masks).
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

from base.registry import FAMILIES

DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
RECOMPUTE_MODES = ("none", "selective", "full")
MIB, GIB = 2 ** 20, 2 ** 30
# Allocator fragmentation on top of the tensors: MindSpore's dry-run guide shows a peak of 23,716 MB without
# fragments and 26,244 MB with them (+10.7%; mindspore.cn tutorials, debug/dryrun, MS_SIMULATION_LEVEL=1).
FRAGMENTATION = 0.10


@dataclass(frozen=True)
class ObjectiveMemory:
    """What an objective changes in the plan (see the module docstring); the default is the causal LM's."""
    sequences: float = 1.0  # sequences the trained model runs per micro-batch sample
    logits: float = 1.0  # fp32 [sequences x seq_len, vocab / tp] arrays kept per micro-batch
    params_delta: int = 0  # parameters of the trained model beyond the family's causal LM (last stage)
    extra: Tuple[Tuple[str, float, str], ...] = ()  # (row, bytes, note) held besides the trained model


@dataclass
class MemoryPlan:
    """Bytes on one device of the fullest pipeline stage."""
    stage: int  # that stage
    num_stages: int
    params: int  # parameters held by the device
    weights: float  # fp32 master weights
    grads: float  # fp32 gradients
    optimizer_states: float  # AdamW m, v as configured (sharded over dp when optimizer_shard)
    optimizer_states_unsharded: float
    optimizer_states_sharded: float
    dp: int  # ranks the sharded states are split over (dp x cp)
    optimizer_shard: bool
    zero3: bool  # gradients sharded too
    dp_only: int  # dp alone
    recompute: str
    activations: float  # with `recompute`, all micro-batches in flight
    activations_by_recompute: Dict[str, float]  # the same for each of RECOMPUTE_MODES
    logits: float  # fp32 logits, last stage only
    extra: Tuple[Tuple[str, float, str], ...]  # the objective's (row, bytes, note), last stage
    total: float
    trained: float = 1.0  # the share of the parameters with gradients and optimizer states (LoRA: its adapters)


def stage_parameters(m: Any, p: Any) -> List[int]:
    """Parameters held by one device of each pipeline stage (the family's accounting)."""
    return FAMILIES[m.family].stage_parameters(m, p)


def layer_activation_bytes(m: Any, p: Any, seq_len: int, micro_batch_size: int, compute_dtype: str,
                           recompute: str, flash_attention: bool) -> float:
    """Activations one decoder layer keeps for its backward, for one micro-batch (see module docstring)."""
    s, b, h, a, t = seq_len, micro_batch_size, m.hidden_size, m.num_heads, p.tp
    sbh = s * b * h * DTYPE_BYTES[compute_dtype]
    if recompute == "full":
        return (sbh / t if p.sequence_parallel else sbh) / p.cp
    replicated, sharded = FAMILIES[m.family].layer_activation_factors(m)
    if recompute == "none" and not flash_attention:
        sharded += a * s / h  # softmax output
    if p.sequence_parallel:
        return sbh * (replicated + sharded) / t / p.cp
    return sbh * (replicated + sharded / t) / p.cp


def _stage_activations(p: Any, stage: int, layers: int, per_layer: Dict[str, float]) -> Dict[str, float]:
    """Activations of a stage for each recompute mode: its layers times its micro-batches in flight (1F1B)."""
    in_flight = min(p.pp - stage, p.micro_batches)
    if p.vp > 1:
        in_flight *= 1 + (p.pp - 1) / (p.pp * p.vp)
    activations = {mode: in_flight * layers * per_layer[mode] for mode in RECOMPUTE_MODES}
    activations["full"] += per_layer["none"]  # the layer being recomputed in the backward, one micro-batch
    return activations


def _stage_plan(p: Any, stage: int, params: int, activations: Dict[str, float], recompute: str,
                logits: float, extra: Tuple[Tuple[str, float, str], ...], trained: float = 1.0) -> MemoryPlan:
    shards = p.dp * p.cp
    optimizer_unsharded = 8.0 * params * trained
    optimizer_sharded = optimizer_unsharded / shards
    optimizer = optimizer_sharded if p.optimizer_shard else optimizer_unsharded
    grads = 4.0 * params * trained / (shards if p.zero3 else 1)
    weights = 4.0 * params / shards if p.optimizer_shard else 4.0 * params
    return MemoryPlan(
        stage=stage, num_stages=p.pp, params=params, weights=weights, grads=grads,
        optimizer_states=optimizer, optimizer_states_unsharded=optimizer_unsharded,
        optimizer_states_sharded=optimizer_sharded, dp=shards, optimizer_shard=p.optimizer_shard, zero3=p.zero3, dp_only=p.dp,
        recompute=recompute, activations=activations[recompute], activations_by_recompute=activations,
        logits=logits, extra=extra,
        total=weights + grads + optimizer + activations[recompute] + logits + sum(n for _, n, _ in extra),
        trained=trained,
    )


def memory_plan(model_cfg: Any, parallel_cfg: Any, seq_len: int, micro_batch_size: int,
                compute_dtype: str, recompute: str, flash_attention: bool,
                objective: ObjectiveMemory = ObjectiveMemory(), trained: float = 1.0) -> MemoryPlan:
    """The memory plan of the pipeline stage that needs the most memory per device.

    micro_batch_size: samples per micro-batch (trainer.micro_batch_size); under pp a step feeds
    `parallel.micro_batches` of them through the pipeline. `objective`: what the objective changes. `trained`:
    the fraction of the parameters that train (LoRA's adapters against the whole model: the frozen base has no
    gradients or optimizer states), spread evenly over the stages.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    m, p = model_cfg, parallel_cfg
    sequences = micro_batch_size * objective.sequences
    per_layer = {mode: layer_activation_bytes(m, p, seq_len, sequences, compute_dtype, mode, flash_attention)
                 for mode in RECOMPUTE_MODES}
    logits = objective.logits * 4.0 * seq_len * sequences * m.vocab_size / p.tp / p.cp
    last = p.pp - 1
    plans = [_stage_plan(p, stage, params + (objective.params_delta if stage == last else 0),
                         _stage_activations(p, stage, m.num_layers // p.pp, per_layer), recompute,
                         logits if stage == last else 0.0, objective.extra if stage == last else (), trained)
             for stage, params in enumerate(stage_parameters(m, p))]
    return max(plans, key=lambda plan: plan.total)


def usable_bytes(device: Any) -> float:
    """What a device leaves to the tensors: its memory less what its runtime reserves."""
    return (device.memory_gb - device.reserved_gb) * GIB


def needed_bytes(plan: MemoryPlan) -> float:
    """The plan with headroom for allocator fragmentation."""
    return plan.total * (1 + FRAGMENTATION)


def fits(plan: MemoryPlan, device: Any) -> bool:
    return needed_bytes(plan) <= usable_bytes(device)


def format_plan(plan: MemoryPlan, device: Any) -> str:
    """A table of the plan in GiB (MiB for small models) and whether it fits the device with headroom."""
    unit, scale = ("GiB", GIB) if plan.total >= GIB else ("MiB", MIB)

    def size(n: float) -> str:
        return f"{n / scale:.2f}"

    shard = "sharded" if plan.optimizer_shard else "replicated"
    over = f"dp={plan.dp}" if plan.dp == plan.dp_only else f"dp x cp = {plan.dp}"
    optimizer_note = (f"{shard} over {over} (unsharded {size(plan.optimizer_states_unsharded)}, "
                      f"sharded {size(plan.optimizer_states_sharded)})")
    by_mode = ", ".join(f"{mode} {size(plan.activations_by_recompute[mode])}" for mode in RECOMPUTE_MODES)
    fraction = needed_bytes(plan) / usable_bytes(device)
    reserved = f", {device.memory_gb:g} less {device.reserved_gb:g} reserved" if device.reserved_gb else ""
    verdict = (f"+{FRAGMENTATION:.0%} fragmentation = {size(needed_bytes(plan))} of {size(usable_bytes(device))} usable"
               f"{reserved} ({fraction:.0%}): {'fits' if fraction <= 1 else 'DOES NOT FIT'}")
    rows = [
        ("weights (fp32)", plan.weights, f"sharded over {over}" if plan.optimizer_shard else ""),
        ("grads (fp32)", plan.grads, f"sharded over {over} (zero3)" if plan.zero3 else
         "" if plan.trained == 1 else f"{plan.trained:.2%} of the parameters train (the adapters; the base is frozen)"),
        ("AdamW m, v (fp32)", plan.optimizer_states, optimizer_note),
        ("activations", plan.activations, f"recompute={plan.recompute} ({by_mode})"),
        ("logits (fp32)", plan.logits, "last stage" if plan.logits else ""),
        *plan.extra,
        ("total", plan.total, verdict),
    ]
    header = (f"memory per device, {unit}: pipeline stage {plan.stage} of {plan.num_stages} (the fullest), "
              f"{plan.params:,} params")
    return "\n".join([header] + [f"  {name:<18}{size(n):>8}  {note}".rstrip() for name, n, note in rows])
