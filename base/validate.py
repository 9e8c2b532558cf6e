"""Cross-field rules checked before anything is built: each failure is one ConfigError naming the key.

Single-field typos and wrong types are already caught by the typed schema (base/schema.py) while Hydra
composes; what is left here are rules that relate several keys, or a key to the machine.
"""
import dataclasses
import difflib
import typing

from omegaconf import DictConfig, OmegaConf

from base.errors import ConfigError, require as _require
from base.paths import task_path
from base.registry import FAMILIES, FORMATS, OBJECTIVES
from base.schema import OPTIMIZERS, Config, global_batch_size, is_sharded, ulysses_degree
from base.schema import world_size as devices_of

__all__ = ["ConfigError", "validate", "validate_layout"]
CHOICES = {
    "model.recompute": ("none", "full", "selective"),
    "optim.schedule": ("cosine", "wsd", "constant"),
    "precision.compute_dtype": ("fp32", "fp16", "bf16"),
    "precision.loss_scale": ("none", "dynamic"),
    "device.target": ("CPU", "Ascend", "GPU"),
    "device.compute_dtype": ("fp32", "fp16", "bf16"),
    "logger.name": ("console", "wandb"),
    "logger.mode": ("auto", "online", "offline", "disabled"),
    "trainer.mode": ("graph", "pynative"),
    "parallel.cp_algo": ("ring", "ulysses", "hybrid"),
    "data.tokenizer.model_type": ("bpe", "unigram"),
}


def _get(cfg: DictConfig, key: str):
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def validate(cfg: DictConfig, world_size: int = 1) -> None:
    """Raise ConfigError for the first rule `cfg` breaks. `world_size`: processes actually launched. The dry run
    checks the same rules but the machine's (this host's devices and processes): what it prints can start."""
    _check_known_keys(cfg)
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        _require(value in allowed, key, f"got {value!r}; choose one of {', '.join(map(str, allowed))}")
    _check_device(cfg)
    _check_parallel(cfg)
    _check_nodes(cfg)
    _check_plugins(cfg)
    _check_model(cfg)
    _check_batch(cfg)
    _check_optim(cfg)
    _check_data(cfg)
    _check_eval_tasks(cfg)
    _check_target(cfg)
    if not cfg.dry_run:
        _check_machine(cfg, world_size)
        _require(not cfg.stage.needs_init or cfg.stage.init_from or cfg.stage.allow_random_init,
                 "stage.init_from", f"stage={cfg.stage.name} continues a trained model: set stage.init_from=<checkpoint "
                 "dir>, or stage.allow_random_init=true")
    peaks = cfg.device.peak_tflops
    _require(cfg.precision.compute_dtype in peaks, "precision", f"device={cfg.device.name} gives no "
             f"{cfg.precision.compute_dtype} peak (device.peak_tflops has {', '.join(peaks)}); use precision=auto or "
             f"one of {', '.join(peaks)}")


def validate_layout(cfg: DictConfig) -> None:
    """The rules a layout (cfg.parallel) can break, in validate's order: the dry run's layout search puts each of
    its grid points through these on the composed config, so a layout it prints passes validate."""
    _check_parallel(cfg)
    _check_plugins(cfg)
    _check_eval_tasks(cfg)
    _check_target(cfg)


def _check_known_keys(cfg: DictConfig) -> None:
    """`+key=value` on the command line bypasses the schema's struct check; walk the schema to catch it."""

    def walk(node, schema, prefix: str) -> None:
        fields = {f.name: f.type for f in dataclasses.fields(schema)}
        for key in node:
            if key not in fields:
                hint = difflib.get_close_matches(key, list(fields), n=1)
                raise ConfigError(prefix + key, "unknown key" + (f"; did you mean {prefix}{hint[0]}?" if hint else
                                                                 f"; known keys: {', '.join(fields)}"))
            kind = fields[key]
            if kind is typing.Any and isinstance(node[key], DictConfig):  # a plug-in group: its preset's own class
                kind = OmegaConf.get_type(node[key])
            if dataclasses.is_dataclass(kind) and isinstance(node[key], DictConfig):
                walk(node[key], kind, f"{prefix}{key}.")
            elif typing.get_origin(kind) is list and dataclasses.is_dataclass(typing.get_args(kind)[0]):
                for i, item in enumerate(node[key]):
                    walk(item, typing.get_args(kind)[0], f"{prefix}{key}[{i}].")

    walk(cfg, Config, "")


def _check_plugins(cfg: DictConfig) -> None:
    """The model family's and the objective's own rules (models/<family>/, objectives/<name>.py), found in the
    registries (an unknown name is refused there, naming the key and the choices)."""
    FAMILIES[cfg.model.family].check(cfg)
    OBJECTIVES[cfg.objective.name].check(cfg)
    if cfg.peft.name == "lora":
        lora = cfg.peft
        _require(lora.r >= 1, "peft.r", f"must be >= 1, got {lora.r}")
        _require(lora.alpha > 0, "peft.alpha", f"must be > 0, got {lora.alpha}")
        _require(0 <= lora.dropout < 1, "peft.dropout", f"must be in [0, 1), got {lora.dropout}")


def _check_model(cfg: DictConfig) -> None:
    m = cfg.model
    scaling = m.get("rope_scaling")
    if scaling is not None and scaling.type != "none":  # RoPE scaled: the pretrained window x the factor
        window = int(m.max_position_embeddings * scaling.factor)
        _require(cfg.data.seq_len <= window, "data.seq_len",
                 f"{cfg.data.seq_len} exceeds model.max_position_embeddings x model.rope_scaling.factor = "
                 f"{m.max_position_embeddings} x {scaling.factor} = {window}; lower data.seq_len or raise the factor")
    _require(cfg.data.seq_len <= m.max_position_embeddings or scaling is not None and scaling.type != "none",
             "data.seq_len", f"{cfg.data.seq_len} exceeds model.max_position_embeddings={m.max_position_embeddings}; "
             "lower data.seq_len or raise max_position_embeddings (with model.rope_scaling for long context)")
    _require(cfg.data.seq_len >= 2, "data.seq_len", f"must be at least 2, got {cfg.data.seq_len}")
    _require(cfg.data.tokenizer.vocab_size == m.vocab_size, "data.tokenizer.vocab_size",
             f"{cfg.data.tokenizer.vocab_size} differs from model.vocab_size={m.vocab_size}")


def _check_device(cfg: DictConfig) -> None:
    """The device preset's numbers (conf/device/): MFU and the dry run's plan divide by them."""
    d = cfg.device
    for dtype, peak in d.peak_tflops.items():
        _require(dtype in CHOICES["precision.compute_dtype"] and peak > 0, f"device.peak_tflops.{dtype}",
                 f"must be a compute dtype ({', '.join(CHOICES['precision.compute_dtype'])}) with a peak > 0, got {peak}")
    _require(d.compute_dtype in d.peak_tflops, "device.compute_dtype",
             f"{d.compute_dtype} has no entry in device.peak_tflops ({', '.join(d.peak_tflops)})")
    _require(0 < d.compute_efficiency <= 1, "device.compute_efficiency", f"must be in (0, 1], got {d.compute_efficiency}")
    _require(d.memory_gb > 0, "device.memory_gb", f"must be > 0, got {d.memory_gb}")
    _require(0 <= d.reserved_gb < d.memory_gb, "device.reserved_gb",
             f"must be in [0, device.memory_gb={d.memory_gb}), got {d.reserved_gb}")
    _require(d.devices_per_node >= 1, "device.devices_per_node", f"must be >= 1, got {d.devices_per_node}")
    _require(d.nics_per_node >= 0, "device.nics_per_node", f"must be >= 0 (0: one per device), got {d.nics_per_node}")
    for key in ("intra_node_gb_per_s", "inter_node_gb_per_s", "hbm_gb_per_s"):
        _require(d[key] >= 0, f"device.{key}", f"must be >= 0 (0: unknown), got {d[key]}")


def _check_nodes(cfg: DictConfig) -> None:
    """`nodes` and parallel=auto: auto is one device in a run and the layout search in the dry run; a layout of
    several nodes fills them (msrun starts devices_per_node workers on each)."""
    p, nodes, per_node = cfg.parallel, cfg.nodes, cfg.device.devices_per_node
    _require(nodes is None or nodes >= 1, "nodes", f"must be >= 1 (the nodes of {per_node} x {cfg.device.name} the "
             f"run spans), got {nodes}")
    if p.name == "auto":
        _require(p.dp == p.tp == p.pp == p.cp == 1, "parallel", "parallel=auto chooses dp, tp, cp and pp itself; for a "
                 "layout of your own start from a preset (parallel=single parallel.dp=...)")
        _require(cfg.dry_run or nodes is None, "parallel", f"parallel=auto with nodes={nodes} is a question for the "
                 "dry run: add dry_run=true, then start the layout it recommends (its command lines)")
        return
    devices = devices_of(p)
    _require(nodes is not None or cfg.node_rank == 0, "node_rank", f"{cfg.node_rank} needs nodes (the run's node count)")
    if nodes is None:
        return
    _require(0 <= cfg.node_rank < nodes, "node_rank", f"must be in [0, nodes={nodes}), got {cfg.node_rank}")
    _require(devices % nodes == 0, "nodes", f"parallel={p.name} uses {devices} devices, which nodes={nodes} cannot "
             "share evenly")
    if cfg.device.target == "CPU":  # one CPU "device" per node, but a CPU node runs several workers (parallel=dp2)
        return
    fits = devices <= per_node if nodes == 1 else devices == nodes * per_node
    _require(fits, "nodes", f"parallel={p.name} uses {devices} devices, but nodes={nodes} x "
             f"device.devices_per_node={per_node} = {nodes * per_node}" + (
                 "" if devices % per_node else f"; set nodes={max(1, devices // per_node)}") +
             ", or parallel=auto dry_run=true to rank the layouts of these nodes")


def _check_expert_parallel(p, m) -> None:
    """parallel.ep: the experts split over ep of the data-parallel ranks, as MindFormers' expert_parallel is (its
    MoE layer's data_parallel // expert_parallel); only a family with experts (its `experts`) takes ep > 1."""
    _require(p.ep >= 1, "parallel.ep", f"must be >= 1, got {p.ep}")
    experts = FAMILIES[m.family].experts
    if p.ep == 1:
        return
    _require(experts is not None, "parallel.ep", f"model.family={m.family} has no experts to split; set parallel.ep=1")
    _require(p.dp % p.ep == 0, "parallel.ep", f"ep={p.ep} does not divide dp={p.dp}: the experts are split over ep "
             "of the data-parallel ranks (MindFormers' expert_parallel); raise dp or lower ep")
    n = experts(m)[0]
    _require(n % p.ep == 0, "parallel.ep", f"ep={p.ep} does not divide the {n} experts (model.num_experts); "
             f"choose ep among {', '.join(str(d) for d in range(1, n + 1) if n % d == 0 and p.dp % d == 0)}")


def _check_parallel(cfg: DictConfig) -> None:
    p, m = cfg.parallel, cfg.model
    for key in ("dp", "tp", "pp", "cp", "vp", "micro_batches"):
        _require(p[key] >= 1, f"parallel.{key}", f"must be >= 1, got {p[key]}")
    _require(m.num_layers % p.pp == 0, "parallel.pp", f"pp={p.pp} does not divide model.num_layers={m.num_layers}")
    _check_context_parallel(cfg)
    if p.vp > 1:  # Megatron's interleaved schedule: pp x vp equal chunks, micro-batches in rounds of pp
        _require(p.pp > 1, "parallel.vp", "virtual pipeline stages interleave a pipeline: needs pp > 1")
        _require(m.num_layers % (p.pp * p.vp) == 0, "parallel.vp", f"pp x vp = {p.pp * p.vp} does not divide "
                 f"model.num_layers={m.num_layers}")
        _require(p.micro_batches % p.pp == 0, "parallel.micro_batches", f"the interleaved schedule feeds "
                 f"micro-batches in rounds of pp={p.pp}; {p.micro_batches} is not a multiple")
    _require(not p.zero3 or p.optimizer_shard, "parallel.zero3", "shards gradients on top of optimizer sharding: "
             "set parallel.optimizer_shard=true")
    _require(not p.tp_overlap or p.tp > 1, "parallel.tp_overlap", "overlaps tensor-parallel collectives: needs tp > 1")
    _require(p.pp == 1 or p.micro_batches >= p.pp, "parallel.micro_batches",
             f"{p.micro_batches} micro-batches cannot fill {p.pp} pipeline stages; use at least {p.pp}")
    _require(not p.sequence_parallel or p.tp > 1, "parallel.sequence_parallel", "needs tp > 1")
    _check_expert_parallel(p, m)
    if is_sharded(p):  # distributed/semi_auto.py: one compiled graph per step
        t = cfg.trainer
        _require(t.grad_accum == 1, "trainer.grad_accum", f"must be 1 under tp/pp/optimizer_shard, got {t.grad_accum}: the step is "
                 "one sharded graph; accumulate with parallel.micro_batches (pp > 1) or a larger dp instead")
        _require(t.spike_factor == 0, "trainer.spike_factor", "loss-spike skipping needs the loss before the update, "
                 "which the one-graph sharded step does not expose; set it to 0 (non-finite steps are still skipped)")
        _require(cfg.model.get("impl", "native") == "native", "model.impl",
                 "tp/pp shard the native model; set model.impl=native")
        _require(not t.eval_tasks, "trainer.eval_tasks", "tasks are scored by the whole model on one device, which a "
                 "tp/pp/optimizer_shard run never builds; set trainer.eval_tasks=[] and score a merged checkpoint "
                 "(python -m distributed.reshard merge, then python -m evaluation)")
    _require(not p.optimizer_shard or p.dp * p.cp > 1, "parallel.optimizer_shard", "needs dp x cp > 1")


def _check_context_parallel(cfg: DictConfig) -> None:
    """cp splits each sequence: the ring into 2 x cp load-balanced causal chunks, Ulysses the heads after its
    all-to-all (each tp shard's heads over cp), hybrid both (planner/context_parallel.py)."""
    p, m, s = cfg.parallel, cfg.model, cfg.data.seq_len
    if p.cp == 1:
        return
    _require(s % (2 * p.cp) == 0, "parallel.cp", f"cp={p.cp} splits data.seq_len={s} into 2 x cp = {2 * p.cp} "
             "load-balanced causal chunks; choose a cp with seq_len divisible by 2 x cp")
    ulysses = ulysses_degree(p.cp, p.cp_algo, p.tp, cfg.device.devices_per_node)
    for key in ("num_heads", "num_kv_heads"):
        _require(m[key] % (p.tp * ulysses) == 0, "parallel.cp_algo", f"{p.cp_algo} splits the heads over tp x "
                 f"{ulysses} = {p.tp * ulysses}, which does not divide model.{key}={m[key]}; use cp_algo=ring")


def _check_batch(cfg: DictConfig) -> None:
    t, p = cfg.trainer, cfg.parallel
    _require(t.micro_batch_size >= 1, "trainer.micro_batch_size", f"must be >= 1, got {t.micro_batch_size}")
    _require(t.grad_accum >= 1, "trainer.grad_accum", f"must be >= 1, got {t.grad_accum}")
    _require(t.max_steps >= 1, "trainer.max_steps", f"must be >= 1, got {t.max_steps}")
    derived = global_batch_size(cfg)
    pipeline = f" x parallel.micro_batches ({p.micro_batches})" if p.pp > 1 else ""
    searched = p.name == "auto" and cfg.dry_run  # the layout search feeds every layout this batch
    _require(t.global_batch_size is None or searched or t.global_batch_size == derived, "trainer.global_batch_size",
             f"{t.global_batch_size} != micro_batch_size ({t.micro_batch_size}) x dp ({p.dp}){pipeline} x "
             f"grad_accum ({t.grad_accum}) = {derived}; fix one of them or leave global_batch_size unset")


def _check_optim(cfg: DictConfig) -> None:
    o, t = cfg.optim, cfg.trainer
    _require(o.name in OPTIMIZERS and OmegaConf.get_type(o) is OPTIMIZERS[o.name], "optim.name",
             f"got {o.name!r}; choose a preset: optim={', '.join(OPTIMIZERS)}")
    _require(0 < o.lr <= 1.0, "optim.lr", f"must be in (0, 1], got {o.lr}")
    _require(0 <= o.min_lr <= o.lr, "optim.min_lr", f"must be in [0, optim.lr={o.lr}], got {o.min_lr}")
    _require(o.warmup_steps is None or 0 <= o.warmup_steps < t.max_steps, "optim.warmup_steps",
             f"must be in [0, trainer.max_steps={t.max_steps}), got {o.warmup_steps}; or leave it unset "
             f"(null) for optim.warmup_fraction ({o.warmup_fraction}) of the run")
    _require(0 <= o.warmup_fraction < 1, "optim.warmup_fraction", f"must be in [0, 1), got {o.warmup_fraction}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.clip_grad_norm >= 0, "optim.clip_grad_norm", f"must be >= 0 (0 disables), got {o.clip_grad_norm}")
    _require(0 < o.decay_fraction <= 1, "optim.decay_fraction", f"must be in (0, 1], got {o.decay_fraction}")
    if "betas" in o:
        _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
                 f"must be two numbers in [0, 1), got {list(o.betas)}")
    if o.name == "came":
        for key in ("beta1", "beta3", "decay_rate"):
            _require(0 <= o[key] <= 1, f"optim.{key}", f"must be in [0, 1], got {o[key]}")
        _require(len(o.eps) == 2 and all(e >= 0 for e in o.eps), "optim.eps",
                 f"must be two numbers >= 0 (added to g^2, and to the instability), got {list(o.eps)}")
        _require(o.clip_threshold > 0, "optim.clip_threshold", f"must be > 0, got {o.clip_threshold}")


def _check_data(cfg: DictConfig) -> None:
    """The data rules a config can break before any file is read (data/ repeats the weight rules for callers
    that skip validation)."""
    d, c = cfg.data, cfg.data.cleaning
    names = [s.name for s in d.sources]
    _require(len(names) > 0, "data.sources", "is empty; list at least one source")
    _require(len(set(names)) == len(names), "data.sources", f"names must be unique, got {names}")
    for key, w in d.weights.items():
        hint = difflib.get_close_matches(key, names, n=1)
        _require(key in names, f"data.weights.{key}", f"no source named {key!r}; " + (
            f"did you mean data.weights.{hint[0]}?" if hint else f"the sources are {', '.join(names)}"))
        _require(w > 0, f"data.weights.{key}", f"must be > 0, got {w}; to leave a source out, remove it from "
                 "data.sources")
    missing = [n for n in names if n not in d.weights]
    _require(not d.weights or not missing, "data.weights", f"no weight for {', '.join(missing)}; give every source "
             "a weight, or none to sample them in proportion to their rows")
    documents = [s.name for s in d.sources if s.val_paths and s.kind not in FORMATS]
    _require(not documents, "data.sources", f"val_paths is for instruction samples; source {', '.join(documents)} "
             "holds documents, whose validation split is data.val_fraction")
    for i, s in enumerate(d.sources):
        _require(s.ties in ("refuse", "drop"), f"data.sources.{i}.ties", f"got {s.ties!r}; choose refuse or drop")
    _require(0 <= d.val_fraction < 1, "data.val_fraction", f"must be in [0, 1), got {d.val_fraction}")
    _require(d.num_workers >= 0, "data.num_workers", f"must be >= 0 (0: in this process), got {d.num_workers}")
    _require(d.shard_rows >= 1, "data.shard_rows", f"must be >= 1, got {d.shard_rows}")
    _require(d.batch_chars >= 1, "data.batch_chars", f"must be >= 1, got {d.batch_chars}")
    forms = ("NFC", "NFKC", "NFD", "NFKD", "none")
    _require(c.unicode_form in forms, "data.cleaning.unicode_form", f"got {c.unicode_form!r}; choose one of "
             f"{', '.join(forms)}")
    _require(c.min_chars >= 0, "data.cleaning.min_chars", f"must be >= 0, got {c.min_chars}")
    for key in ("max_symbol_fraction", "max_repeated_line_fraction", "near_dedup_threshold"):
        _require(0 < c[key] <= 1, f"data.cleaning.{key}", f"must be in (0, 1], got {c[key]}")


def _check_eval_tasks(cfg: DictConfig) -> None:
    t = cfg.trainer
    _require(t.eval_task_items >= 0, "trainer.eval_task_items", f"must be >= 0 (0: every item), got {t.eval_task_items}")
    if t.eval_tasks:
        _require(OBJECTIVES[cfg.objective.name].Objective.token_nll is not None, "trainer.eval_tasks",
                 f"tasks score a causal LM's log-likelihoods through the objective's per-token NLL (token_nll), "
                 f"and objective={cfg.objective.name} has none (set trainer.eval_tasks=[]; `python -m evaluation CKPT "
                 f"tasks=[...]` scores a fine-tuned causal checkpoint)")
        _require(not is_sharded(cfg.parallel), "trainer.eval_tasks", "tasks run the model outside the sharded "
                 "step graph, which tp/pp/optimizer sharding does not allow; score the checkpoints with "
                 "`python -m evaluation CKPT tasks=[...]` instead (set trainer.eval_tasks=[])")
        for name in t.eval_tasks:
            _require(task_path(name).is_file(), "trainer.eval_tasks", f"{task_path(name)}: no such task file (build "
                     "the real tasks with `python -m builders.tasks build`, or give a .jsonl path)")


def devices_here(target: str) -> int:
    """How many `target` devices MindSpore reports on this machine (0 where its package has no such backend), read
    without MindSpore's warnings about the backends it could not load: the refusal says it in one line."""
    import logging

    from mindspore import hal

    logging.disable(logging.WARNING)
    try:
        return hal.device_count(target) if hal.is_available(target) else 0
    finally:
        logging.disable(logging.NOTSET)


def _check_target(cfg: DictConfig) -> None:
    """The config against its device target (the preset's, not this host's): the run and the dry run both check
    these, so a planned layout can start on the device it was planned for."""
    p, d, target = cfg.parallel, cfg.device, cfg.device.target
    devices = devices_of(p)
    if target == "CPU" and (p.tp > 1 or p.pp > 1 or p.cp > 1 or p.ep > 1):
        cp = f" x cp={p.cp}" if p.cp > 1 else ""
        ep = f", ep={p.ep}" if p.ep > 1 else ""
        raise ConfigError("parallel", f"parallel={p.name} (dp={p.dp} x tp={p.tp}{cp} x pp={p.pp}{ep}) needs "
                          f"{devices} Ascend/GPU devices, found CPU (device={d.name}): MindSpore runs tensor, context, "
                          "pipeline and expert parallelism only on Ascend/GPU. On such nodes set device=ascend910b|h100|a100; "
                          "here add that device= and dry_run=true to see its layout and memory plan")
    _require(target != "CPU" or not is_sharded(p), "parallel.optimizer_shard", "optimizer sharding runs in "
             "MindSpore's semi-auto parallel mode, which needs Ascend/GPU; set parallel.optimizer_shard=false on CPU")
    _require(cfg.precision.compute_dtype != "bf16" or target != "CPU", "precision",
             "bf16 needs Ascend/GPU: MindSpore's CPU kernels have no bf16 matmul; use precision=fp32 or fp16")
    _require(not cfg.model.flash_attention or target == "Ascend", "model.flash_attention",
             f"ops.flash_attention_score has no {target} kernel; set model.flash_attention=null (auto) or false")
    _require(p.cp == 1 or target == "Ascend", "parallel.cp", f"context parallelism shards FlashAttentionScore over "
             f"the sequence (its ring attention), which has no {target} kernel; set parallel.cp=1")
    _require(p.cp == 1 or cfg.model.get("flash_attention", True) is not False, "model.flash_attention",
             "context parallelism splits flash attention; set model.flash_attention=null (auto) or true")
    _require(not p.tp_overlap or target == "Ascend", "parallel.tp_overlap", f"overlaps tensor-parallel communication "
             f"through MindSpore's Ascend passes (parallel_speed_up_json), which {target} does not run; set it false")


def _check_machine(cfg: DictConfig, launched: int) -> None:
    """The config against this machine, before anything is started (train.py relaunches under msrun after it)."""
    p, d, target = cfg.parallel, cfg.device, cfg.device.target
    devices = devices_of(p)
    if target != "CPU":
        here = devices_here(target)
        _require(here > 0, "device", f"device={d.name}: this machine has no {target} devices; plan with dry_run=true "
                 "or use device=cpu")
        local = devices // (cfg.nodes or 1)
        _require(local <= here, "parallel", f"parallel={p.name} runs {local} workers on this node, which has {here} "
                 f"{target} devices" + ("" if cfg.nodes else f"; across nodes set nodes={-(-devices // here)} "
                                        "(README: Across nodes)") + ", or add dry_run=true for its plan")
    _require(devices == launched, "parallel",
             f"parallel={p.name} needs dp x tp x cp x pp = {devices} processes but {launched} were launched; "
             f"start it with msrun --worker_num={devices} --local_worker_num={devices} --join=True train.py ...")
