"""Published training runs the dry run's time model (planner/timing.py) is held against, and the fit of its one
free number, device.compute_efficiency. tests/test_time_published.py asserts each prediction within 30%.

    scripts/venv.sh python -m benchmarks.published_runs   # predicted vs published tokens/s per device, and the fit

The runs and the fit live here, beside the time model, because tests/test_time_published.py asserts them; the
benchmark prints the table.

Each run is mapped onto the planner's terms (a Llama-family shape, a dp x tp x pp layout, micro-batches, recompute)
and predicted with the device preset of its hardware (conf/device/), whose compute_efficiency is the same 0.56 for
every device. That number is fitted here to the Megatron-LM rows alone (the efficiency at which the geometric mean of
their predicted/published ratios is 1); the MindFormers rows, on other hardware and another framework, are
predicted with it, not fitted.

[N] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
    (arXiv:2104.04473), Table 1: GPT models, vocabulary 51,200, sequence 2,048, on Selene (DGX A100 80 GB nodes:
    NVLink inside, 8 x 200 Gb/s HDR InfiniBand between), mixed precision, activation recomputation. Columns used:
    attention heads, hidden size, layers, tensor- and pipeline-parallel size, GPUs, batch size, and the achieved
    teraFLOP/s per GPU, which counts Eq. 3's F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration (the
    recomputed forward included). Published tokens/s per GPU = achieved FLOP/s / (F / (B s)).
    Mapping: a GPT layer has 12 h^2 matmul weights, as a SwiGLU of width 8h/3 (the planner's Llama family; FLOPs
    equal, the width rounded to an integer), multi-head attention, tied embeddings; dp = GPUs / (tp pp);
    full recompute. Assumed (the table does not say): micro-batch size 1, the non-interleaved 1F1B schedule.
[MF] MindFormers' model library (mindspore.cn, MindFormers docs, "模型库" / Models, the r1.3 tables), training
    performance of Llama 2 at 4K on Atlas 800T A2 (Ascend 910B), tokens/s/p, each with its configuration file:
      7B  4160  configs/llama2/pretrain_llama2_7b_bf16.yaml: data_parallel 8, model_parallel 1, pipeline_stage 1,
                enable_parallel_optimizer True, batch_size 1, gradient_accumulation_steps 8, recompute False,
                use_flash_attention True, compute_dtype bfloat16
      13B 1691  configs/llama2/finetune_llama2_13b_bf16.yaml: data_parallel 8, model_parallel 1, pipeline_stage 1,
                enable_parallel_optimizer True, batch_size 4, recompute True, use_flash_attention True, bfloat16
      70B 337   configs/llama2/finetune_llama2_70b_bf16_32p.yaml: data_parallel 1, model_parallel 4,
                pipeline_stage 8, use_seq_parallel True, micro_batch_num 256, batch_size 1, select_recompute on
                part of the layers ([8,4,4,1,1,1,1,1] per stage), use_flash_attention True, bfloat16
    Mapping: the Llama 2 presets (conf/model/), gradient accumulation as micro-batches of one step, select_recompute
    as selective everywhere (it adds the attention core's forward only: < 2% here).
[MC] Megatron-Core's MoE README (NVIDIA/Megatron-LM, megatron/core/transformer/moe/README.md): "468 TFLOPS for
    Mixtral 8X7B bf16 training" (MCore v0.9), with its reference parallel mapping for Mixtral 8x7B (dropless,
    all-to-all dispatcher, BF16, 64 H100 80 GB in 8-GPU nodes: NVLink 4 inside, 8 x 400 Gb/s InfiniBand between;
    sequence 4,096, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch 256, distributed optimizer). Published
    tokens/s per GPU = 468e12 / the moe family's FLOPs per token (6 x the active matmul weights + attention: 82.9G).
    Mapping: the mixtral_8x7b preset, dp 16, ep 8, optimizer_shard, no recompute; the planner has no interleaved
    (virtual) pipeline, so its bubble is VP 8's times 8: the prediction errs low.
Not used: torchtitan's figures (docs/performance.md). Its A100 runs (64 GPUs, FSDP) do not state the network
between nodes, which decides them; its H100 runs are on power-capped 500 W HBM2e parts whose peak torchtitan says it
does not know, and its Llama 3.1 8B there (5,762 tokens/s per GPU on 8 GPUs, FSDP) implies an efficiency of 0.36
where these rows give 0.50-0.63 (docs/planning.md). The Llama 2 paper's GPU-hours give no layout.
"""
import math
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List, Tuple

from omegaconf import OmegaConf

from base.registry import FAMILIES
from base.schema import REPO_ROOT, DeviceConfig
from planner.timing import step_time


@dataclass(frozen=True)
class Run:
    name: str
    source: str  # N | MF (the module docstring)
    device: str  # conf/device preset
    model: dict  # the family's shape (a conf/model preset's keys)
    dp: int
    tp: int
    pp: int
    sequence_parallel: bool
    optimizer_shard: bool
    seq_len: int
    micro_batch_size: int
    micro_batches: int
    recompute: str
    published: float  # tokens/s per device
    family: str = "llama"
    ep: int = 1


def megatron(name: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
             teraflops: float) -> Run:
    """A row of [N] Table 1 in the planner's terms."""
    s, vocab = 2048, 51200
    flops_per_token = 96 * layers * hidden ** 2 * (1 + s / (6 * hidden) + vocab / (16 * layers * hidden))
    dp = gpus // (tp * pp)
    shape = dict(vocab_size=vocab, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=heads,
                 intermediate_size=round(8 * hidden / 3), tie_embeddings=True)
    return Run(f"Megatron-LM GPT {name}", "N", "a100", shape, dp, tp, pp, tp > 1, False, s, 1, batch // dp, "full",
               teraflops * 1e12 / flops_per_token)


def preset(name: str) -> dict:
    raw = OmegaConf.load(os.path.join(REPO_ROOT, "conf", "model", f"{name}.yaml"))
    return {k: v for k, v in raw.items() if k not in ("defaults", "name")}


RUNS: List[Run] = [
    megatron("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    megatron("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    megatron("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    megatron("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    megatron("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    megatron("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    megatron("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    megatron("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    megatron("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    megatron("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    Run("MindFormers Llama 2 7B", "MF", "ascend910b", preset("7b"), 8, 1, 1, False, True, 4096, 1, 8, "none", 4160),
    Run("MindFormers Llama 2 13B", "MF", "ascend910b", preset("13b"), 8, 1, 1, False, True, 4096, 4, 1, "full", 1691),
    Run("MindFormers Llama 2 70B", "MF", "ascend910b", preset("70b"), 1, 4, 8, True, True, 4096, 1, 256, "selective",
        337),
    Run("Megatron-Core Mixtral 8x7B", "MC", "h100", preset("mixtral_8x7b"), 16, 1, 4, False, True, 4096, 1, 16, "none",
        468e12 / 82_933_972_992, family="moe", ep=8),
]


def device(name: str):
    """A conf/device preset on its schema."""
    raw = OmegaConf.load(os.path.join(REPO_ROOT, "conf", "device", f"{name}.yaml"))
    raw.pop("defaults")
    return OmegaConf.merge(OmegaConf.structured(DeviceConfig), raw)


def model(run: Run):
    return OmegaConf.merge(OmegaConf.structured(FAMILIES[run.family].Config(name=run.name)), run.model)


def predict(run: Run, efficiency: float = None):
    """planner/timing.py's step for the run, with its device preset (or another compute_efficiency)."""
    d = device(run.device)
    if efficiency is not None:
        d.compute_efficiency = efficiency
    layout = SimpleNamespace(dp=run.dp, tp=run.tp, pp=run.pp, ep=run.ep, sequence_parallel=run.sequence_parallel,
                             optimizer_shard=run.optimizer_shard, micro_batches=run.micro_batches)
    return step_time(model(run), layout, d, run.seq_len, run.micro_batch_size, run.micro_batches, "bf16", run.recompute)


def ratio(run: Run, efficiency: float = None) -> float:
    return predict(run, efficiency).tokens_per_s_per_device / run.published


def solve(f: Callable[[float], float], low: float = 0.05, high: float = 1.0) -> float:
    """The x in [low, high] where the increasing f crosses 1 (bisection)."""
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if f(middle) < 1 else (low, middle)
    return (low + high) / 2


def fit(runs: List[Run]) -> Tuple[float, List[float]]:
    """The efficiency whose predictions have a geometric-mean ratio of 1 over `runs`, and each run's own."""
    fitted = solve(lambda e: math.exp(sum(math.log(ratio(r, e)) for r in runs) / len(runs)))
    return fitted, [solve(lambda e, r=r: ratio(r, e)) for r in runs]
