"""`dry_run=true`: what a run would be, without building weights. Pure Python, so it answers for a 70B model on
64 devices from a laptop.

With a layout (parallel=tp8pp2, ...): its size, FLOPs, rank layout, memory per device, predicted step time and
communication, and, when it does not fit, the nearest layouts of the same devices that do. With parallel=auto (the
default) on more than one device (nodes x device.devices_per_node): the layouts that fit, fastest first
(planner/advisor.py), the best one's plan, and the commands that start it (planner/launch.py). docs/planning.md
explains the model behind each number.
"""
import os
import textwrap
from typing import Any, List, Optional, Sequence

from base.errors import ConfigError
from base.paths import REPO_ROOT
from base.registry import FAMILIES, OBJECTIVES, PEFT
from base.schema import global_batch_size, peak_tflops, pipeline_micro_batches, world_size
from planner.advisor import MAX_DEVICES, Option, Search, best_of, candidate_of, format_table, global_batch, summary_row
from planner.launch import format_launch
from planner.layout import Layout
from planner.memory import FRAGMENTATION, MemoryPlan, ObjectiveMemory, fits, format_plan, memory_plan, usable_bytes
from planner.timing import format_time, step_time

SHOWN_LAYOUTS = 5  # rows of the advisor's table


def _count(n: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:.0f}"


def _presets(group: str) -> str:
    names = sorted(f[:-5] for f in os.listdir(os.path.join(REPO_ROOT, "conf", group)) if f.endswith(".yaml"))
    return "|".join(names)


def header(cfg: Any, devices: int) -> str:
    """The first line: the hardware and precision planned for, and how to plan for others."""
    d, p = cfg.device, cfg.precision
    per_node = d.devices_per_node
    nodes = f" ({devices // per_node} nodes x {per_node})" if devices > per_node and devices % per_node == 0 else ""
    why = " (precision=auto: the device's compute dtype)" if p.name == "auto" else f" (precision={p.name})"
    return (f"dry run for {devices} x {d.name}{nodes} in {p.compute_dtype}{why}; plan for others with "
            f"device={_presets('device')} nodes=N precision={_presets('precision')}")


def _model_name(m: Any, overrides: Optional[Sequence[str]]) -> str:
    """The preset's name, with the command line's model.* overrides when there are any (the shape planned is not
    the preset's then)."""
    changed = [o.lstrip("+~") for o in overrides or () if o.lstrip("+~").startswith("model.")]
    return f"{m.name} with {' '.join(changed)}" if changed else m.name


def _model_section(m: Any, overrides: Optional[Sequence[str]] = None) -> str:
    fam = FAMILIES[m.family]
    total = fam.parameter_count(m)["total"]
    return "\n".join([f"model {_model_name(m, overrides)}: {_count(total)} parameters ({total:,})",
                      *fam.describe(m, _count)])


def _compute_section(cfg: Any, world: int) -> str:
    m, seq_len = cfg.model, cfg.data.seq_len
    fam = FAMILIES[m.family]
    flops = fam.flops_per_token(m, seq_len)
    dense = 6 * fam.matmul_parameter_count(m)
    tokens = global_batch_size(cfg) * seq_len
    peak = peak_tflops(cfg)
    ideal_step = flops * tokens / (world * peak * 1e12)
    return "\n".join([
        f"FLOPs per token (training, seq_len {seq_len}): {_count(flops)} = 6N {_count(dense)} "
        f"+ attention {_count(flops - dense)}",
        f"tokens per step: {tokens:,} ({global_batch_size(cfg)} sequences x {seq_len}); "
        f"{flops * tokens:.3g} FLOP per step",
        f"step time at 100% MFU on {world} x {cfg.device.name} ({peak:g} TFLOP/s {cfg.precision.compute_dtype}): "
        f"{ideal_step:.3g} s",
    ])


def _attention(cfg: Any) -> str:
    """The attention kind the composed Config's model would build on its device (its family's attention_kind)."""
    p = cfg.parallel
    return FAMILIES[cfg.model.family].attention_kind(cfg.model, cfg.device, cfg.precision.compute_dtype,
                                                     p.tp * p.cp * p.pp > 1)


def _needs(cfg: Any) -> ObjectiveMemory:
    plugin = OBJECTIVES[cfg.objective.name]
    return plugin.memory(cfg) if plugin.memory is not None else ObjectiveMemory()


def trained_fraction(cfg: Any) -> float:
    """The share of the model's parameters that train: with a PEFT method that counts its adapters
    (adapter_parameters, e.g. LoRA's) those (added to the frozen whole), when the family lists its linear cells
    (linear_shapes); 1 otherwise."""
    fam = FAMILIES[cfg.model.family]
    count = PEFT[cfg.peft.name].adapter_parameters
    if count is None or fam.linear_shapes is None:
        return 1.0
    adapters = count(fam.linear_shapes(cfg.model), cfg.peft, fam.LORA_TARGETS or ())
    return adapters / (fam.parameter_count(cfg.model)["total"] + adapters)


def config_plan(cfg: Any) -> MemoryPlan:
    """The memory plan of a composed Config: its attention kind (no [S, S] activations unless plain), what its
    objective adds (a reference model, a value head...) and what trains (trained_fraction)."""
    m, p = cfg.model, cfg.parallel
    return memory_plan(m, p, cfg.data.seq_len, cfg.trainer.micro_batch_size, cfg.precision.compute_dtype,
                       m.recompute, _attention(cfg) != "plain", _needs(cfg), trained_fraction(cfg))


def planned_devices(cfg: Any) -> int:
    """The devices the dry run plans for: the layout's, or with parallel=auto nodes (default 1) x devices_per_node."""
    p = cfg.parallel
    if p.name == "auto":
        return (cfg.nodes or 1) * cfg.device.devices_per_node
    return world_size(p)


def dry_run_report(cfg: Any, overrides: Optional[Sequence[str]] = None) -> str:
    """The full dry-run text for a composed Config. `overrides`: the command line's (for the launch commands);
    without them the commands carry model=, device= and data.seq_len=."""
    devices = planned_devices(cfg)
    if cfg.parallel.name == "auto" and devices > 1:
        return advisor_report(cfg, devices, overrides)
    return layout_report(cfg, overrides)


def layout_report(cfg: Any, overrides: Optional[Sequence[str]] = None) -> str:
    """A fixed layout: the plan, its predicted time and communication, and what fits instead when it does not."""
    m, p = cfg.model, cfg.parallel
    layout = Layout.from_config(p, m.num_layers)
    plan = config_plan(cfg)
    pipeline = f" x {pipeline_micro_batches(cfg)} pipeline micro-batches" if p.pp > 1 else ""
    time = step_time(m, p, cfg.device, cfg.data.seq_len, cfg.trainer.micro_batch_size,
                     pipeline_micro_batches(cfg) * cfg.trainer.grad_accum, cfg.precision.compute_dtype, m.recompute,
                     _needs(cfg).sequences, plain_attention=_attention(cfg) == "plain")
    sections = [
        header(cfg, layout.world_size) + "\n"
        f"dry run: model {_model_name(m, overrides)} x parallel {p.name} on {layout.world_size} x {cfg.device.name}\n"
        f"  batch: micro_batch_size {cfg.trainer.micro_batch_size}{pipeline} x dp {p.dp} x grad_accum "
        f"{cfg.trainer.grad_accum}, seq_len {cfg.data.seq_len}\n"
        f"  compute {cfg.precision.compute_dtype}, recompute {m.recompute}, attention {_attention(cfg)}"
        f"{f' (heads split over tp={p.tp})' if p.tp > 1 else ''}, optimizer_shard {p.optimizer_shard}"
        f"{' (zero3)' if p.zero3 else ''}, sequence_parallel {p.sequence_parallel}"
        f"{f', cp {p.cp} ({p.cp_algo})' if p.cp > 1 else ''}{f', vp {p.vp}' if p.vp > 1 else ''}"
        f"{', tp_overlap' if p.tp_overlap else ''}",
        _model_section(m, overrides),
        _compute_section(cfg, layout.world_size),
        "layout\n" + textwrap.indent(layout.describe(), "  "),
        format_time(time, cfg.device, cfg.precision.compute_dtype),
        format_plan(plan, cfg.device),  # last: readers take the memory table from the end of the report
    ]
    if not fits(plan, cfg.device):
        sections.append(_alternatives(cfg, layout.world_size))
    return "\n\n".join(sections)


def _alternatives(cfg: Any, devices: int) -> str:
    """For a layout that does not fit: the nearest layouts of the same devices and batch that do, or how many
    devices any layout needs."""
    search, batch = Search(cfg), global_batch_size(cfg)
    near = search.nearest(candidate_of(cfg), batch)
    if not near:
        return _no_fit_line(cfg, search, devices, batch)
    usable = usable_bytes(cfg.device)
    return "\n".join([f"the nearest layouts of these {devices} devices that fit ({batch} sequences per step):",
                      textwrap.indent(format_table([summary_row(i + 1, o, usable) for i, o in enumerate(near)]), "  "),
                      "  run the first with: " + " ".join(near[0].candidate.overrides())])


def _no_fit_line(cfg: Any, search: Search, devices: int, batch: int) -> str:
    """Why nothing fits: how many devices any layout needs, and what the rules removed from the search of
    `devices` (read before devices_needed searches other counts)."""
    restricted = "".join(f"; {line.strip()}" for line in _restrictions(search))
    needed = search.devices_needed(devices, batch)
    per_node = cfg.device.devices_per_node
    at_least = (f"needs at least {needed} (nodes={needed // per_node})" if needed else
                f"not on {MAX_DEVICES} either: shorten data.seq_len, use a device with more memory, or give "
                f"trainer.global_batch_size more sequences (more micro-batches allow more pipeline stages)")
    return (f"no layout of {devices} x {cfg.device.name} fits model={cfg.model.name} at seq_len {cfg.data.seq_len} "
            f"({batch} sequences per step): {at_least}{restricted}")


def advisor_report(cfg: Any, devices: int, overrides: Optional[Sequence[str]] = None) -> str:
    """parallel=auto: the layouts of `devices` that fit, fastest first; the best one's plan and launch commands."""
    search, batch, d = Search(cfg), global_batch(cfg), cfg.device
    options = search.options(devices, batch)
    ranked = best_of(options)
    if not ranked:
        raise ConfigError("nodes", _no_fit_line(cfg, search, devices, batch))
    best = ranked[0]
    usable = usable_bytes(d)
    given = "trainer.global_batch_size" if cfg.trainer.global_batch_size else (
        "trainer.global_batch_size unset: Llama 2's 4M tokens; set it to plan yours")
    reserved = f", {d.memory_gb:g} less {d.reserved_gb:g} reserved" if d.reserved_gb else ""
    table = format_table([summary_row(i + 1, o, usable) for i, o in enumerate(ranked[:SHOWN_LAYOUTS])])
    intro = "\n".join([
        header(cfg, devices),
        f"layouts for model {_model_name(cfg.model, overrides)} on {devices} x {d.name}: {batch:,} sequences x "
        f"{cfg.data.seq_len} = {batch * cfg.data.seq_len:,} tokens per step ({given})",
        *_restrictions(search),
        f"  {sum(o.fits for o in options)} of {len(options)} layouts fit in {usable / 2 ** 30:g} GiB usable per device"
        f"{reserved} with {FRAGMENTATION:.0%} for fragmentation; the fastest {min(len(ranked), SHOWN_LAYOUTS)} (of "
        f"layouts alike but for recompute or optimizer sharding, those beaten on both time and memory left out):",
        textwrap.indent(table, "  "),
    ])
    user = list(overrides) if overrides is not None else [
        f"model={cfg.model.name}", f"device={d.name}", f"data.seq_len={cfg.data.seq_len}"]
    return "\n\n".join([
        intro,
        _model_section(cfg.model, overrides),
        _best_section(cfg, best),
        format_plan(best.plan, d),
        format_time(best.time, d, cfg.precision.compute_dtype),
        "layout\n" + textwrap.indent(Layout(best.candidate.dp, best.candidate.tp, best.candidate.pp,
                                             cfg.model.num_layers, best.candidate.cp, best.candidate.vp,
                                             best.candidate.ep).describe(), "  "),
        format_launch(user, best.candidate, d, devices // d.devices_per_node if devices > d.devices_per_node else 1,
                      cfg.precision.compute_dtype, FAMILIES[cfg.model.family].experts is not None),
    ])


def _restrictions(search: Search) -> List[str]:
    """One line: the rules that removed grid points from the search, by the key that refused them, with the first
    refusal's message and how many points the key removed."""
    if not search.refused:
        return []
    reasons = sorted(search.refused.values(), key=lambda item: -item[1])
    return ["  the rules removed: " + "; ".join(f"{n} grid points, e.g. {why}" for why, n in reasons)]


def _best_section(cfg: Any, best: Option) -> str:
    c = best.candidate
    pipeline = f"{c.micro_batches} pipeline micro-batches" if c.pp > 1 else (
        f"grad_accum {c.micro_batches}" if c.micro_batches > 1 else "no accumulation")
    return (f"the fastest: {c.describe()}, micro_batch_size {c.micro_batch_size}, {pipeline}, recompute {c.recompute}, "
            f"attention {FAMILIES[cfg.model.family].attention_kind(cfg.model, cfg.device, cfg.precision.compute_dtype, c.tp * c.cp * c.pp > 1)}\n"
            f"  overrides: {' '.join(c.overrides())}")
