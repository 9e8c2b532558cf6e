"""`dry_run=true`: what a run would be (layout, size, FLOPs, memory per device), without building weights.

Pure Python, so it answers for a 70B model on 64 devices from a laptop.
"""
import textwrap
from typing import Any

from base.registry import FAMILIES, OBJECTIVES
from base.schema import global_batch_size, pipeline_micro_batches
from planner.layout import Layout
from planner.memory import MemoryPlan, ObjectiveMemory, format_plan, memory_plan


def _count(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _model_section(m: Any) -> str:
    fam = FAMILIES[m.family]
    total = fam.parameter_count(m)["total"]
    return "\n".join([f"model {m.name}: {_count(total)} parameters ({total:,})",
                      *fam.describe(m, _count)])


def _compute_section(cfg: Any, world: int) -> str:
    m, seq_len = cfg.model, cfg.data.seq_len
    fam = FAMILIES[m.family]
    flops = fam.flops_per_token(m, seq_len)
    dense = 6 * fam.matmul_parameter_count(m)
    tokens = global_batch_size(cfg) * seq_len
    ideal_step = flops * tokens / (world * cfg.device.peak_tflops * 1e12)
    return "\n".join([
        f"FLOPs per token (training, seq_len {seq_len}): {_count(flops)} = 6N {_count(dense)} "
        f"+ attention {_count(flops - dense)}",
        f"tokens per step: {tokens:,} ({global_batch_size(cfg)} sequences x {seq_len}); "
        f"{flops * tokens:.3g} FLOP per step",
        f"step time at 100% MFU on {world} x {cfg.device.name} ({cfg.device.peak_tflops:g} TFLOP/s): "
        f"{ideal_step:.3g} s",
    ])


def _attention(cfg: Any) -> str:
    """The attention kind the composed Config's model would build on its device (its family's attention_kind)."""
    p = cfg.parallel
    return FAMILIES[cfg.model.family].attention_kind(cfg.model, cfg.device.target, cfg.precision.compute_dtype,
                                                     p.tp * p.pp > 1)


def config_plan(cfg: Any) -> MemoryPlan:
    """The memory plan of a composed Config: its attention kind (no [S, S] activations unless plain) and what its
    objective adds (a reference model, a value head...)."""
    m, p = cfg.model, cfg.parallel
    plugin = OBJECTIVES[cfg.objective.name]
    needs = plugin.memory(cfg) if hasattr(plugin, "memory") else ObjectiveMemory()
    return memory_plan(m, p, cfg.data.seq_len, cfg.trainer.micro_batch_size, cfg.precision.compute_dtype,
                       m.recompute, _attention(cfg) != "plain", needs)


def dry_run_report(cfg: Any) -> str:
    """The full dry-run text for a composed Config."""
    m, p = cfg.model, cfg.parallel
    layout = Layout.from_config(p, m.num_layers)
    plan = config_plan(cfg)
    pipeline = f" x {pipeline_micro_batches(cfg)} pipeline micro-batches" if p.pp > 1 else ""
    return "\n\n".join([
        f"dry run: model {m.name} x parallel {p.name} on {layout.world_size} x {cfg.device.name}\n"
        f"  batch: micro_batch_size {cfg.trainer.micro_batch_size}{pipeline} x dp {p.dp} x grad_accum "
        f"{cfg.trainer.grad_accum}, seq_len {cfg.data.seq_len}\n"
        f"  compute {cfg.precision.compute_dtype}, recompute {m.recompute}, attention {_attention(cfg)}, optimizer_shard {p.optimizer_shard}, sequence_parallel "
        f"{p.sequence_parallel}",
        _model_section(m),
        _compute_section(cfg, layout.world_size),
        "layout\n" + textwrap.indent(layout.describe(), "  "),
        format_plan(plan, cfg.device.memory_gb),
    ])
