"""The Llama family: a decoder-only Transformer (RMSNorm, RoPE, GQA, SwiGLU), native or MindFormers' own.

    config.py      LlamaConfig, the typed `model` group      model.py        the native MindSpore model
    accounting.py  parameters and FLOPs from the config      mindformers.py  MindFormers' Llama + its export
    hf.py          Hugging Face names and config.json        plan.py         tensor/pipeline parallel plan
    kernels.py     the CPU kernels' twins of model.py's cells (apply_kernels swaps them in where they apply)
    device_ops.py  the devices' twins: CPU workarounds, Ascend's fused RMSNorm and RoPE (apply_kernels too)

Importing this package is cheap (no MindSpore): the config schema and the dry run use it.
"""
from typing import Set

from base.errors import ConfigError, require
from base.schema import as_device, use_flash_attention
from models.common import rope
from models.common.checks import check_attention_shape
from models.llama import hf
from models.llama.accounting import flops_per_token, layer_activation_factors, linear_shapes, \
    matmul_parameter_count, parameter_count, stage_parameters
from models.llama.config import LlamaConfig as Config

__all__ = ["Config", "LORA_TARGETS", "apply_kernels", "attention_kind", "build", "check", "describe",
           "device_passes", "flops_per_token", "hf", "kernel_libraries", "layer_activation_factors",
           "matmul_parameter_count", "parameter_count", "stage_parameters"]
CAUSAL = True  # decoder-only: objectives that need bidirectional attention refuse it
# the device twins (device_passes) that need the model outside a tp/pp layout
UNSHARDED_PASSES = frozenset({"cpu", "ascend-rope"})
# peft=lora's cells when peft.target_modules is null: the attention and MLP projections, every linear cell but the
# head (as QLoRA adapts them)
LORA_TARGETS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo",
                "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


def build(cfg: Config, seq_len: int, compute_dtype: str, use_flash: bool, seed: int, sharded: bool = False):
    """The model cell: tokens [B, S] -> fp32 logits [B, S, vocab], plain MindSpore ops (apply_kernels swaps in the
    CPU kernels' twins after). `sharded`: weights initialised by the sharded compile, each rank its slices."""
    if cfg.impl == "mindformers":
        from models.llama.mindformers import MindFormersLlama

        return MindFormersLlama(cfg, seq_len, compute_dtype, use_flash, seed)  # (validation: never sharded)
    from models.llama.model import LlamaForCausalLM

    model = LlamaForCausalLM(cfg, compute_dtype, use_flash, seed, deferred=sharded)
    model.model.set_rope_length(seq_len)  # dynamic NTK: the tables of the training length
    return model


def kernel_libraries(cfg: Config, compute_dtype: str, device, sharded: bool) -> Set[str]:
    """The kernels/ libraries this model runs on (models/llama/kernels.py has their twins), from the config alone:
    "attention" (model.attention_kernel) and "layers" (model.layer_kernels: RMSNorm, SwiGLU, RoPE, the Linears'
    products and the objectives' cross-entropy over the logits). `auto` takes a library where it applies (the
    native model in fp32 on a device that runs them (device.cpu_kernels) outside a tp/pp layout, `sharded`, whose
    plan sets its strategies on the plain ops;
    the attention also without flash attention or model.attention_chunk) and is built (kernels.library: not on a
    non-x86 host, nor with MINDLAB_KERNELS=plain); `fused` where it is not built is one ConfigError (validation
    refuses it where it does not apply); `plain` never."""
    import kernels

    device = as_device(device)
    applies = cfg.impl == "native" and compute_dtype == "fp32" and device.cpu_kernels and not sharded
    attention = applies and not cfg.attention_chunk and not use_flash_attention(cfg, device)
    chosen = set()
    for library, key, fits in (("attention", "attention_kernel", attention), ("layers", "layer_kernels", applies)):
        setting = cfg[key]
        if setting == "plain" or (setting == "auto" and not fits):
            continue
        path, why = kernels.library(library)
        require(path is not None or setting == "auto", f"model.{key}", f"fused: {why}; or set model.{key}=plain")
        if path is not None:
            chosen.add(library)
    return chosen


def device_passes(cfg: Config, device, sharded: bool) -> Set[str]:
    """The device twins (models/llama/device_ops.py) the native model takes: those the device preset lists
    (device.device_ops: "cpu", MindSpore's CPU kernels' workarounds; "ascend", the fused RMSNorm; "ascend-rope", the
    fused RoPE), less, in a tp/pp layout (whose plan sets its strategies on the plain ops), UNSHARDED_PASSES."""
    if cfg.impl != "native":
        return set()
    passes = set(as_device(device).device_ops)
    return passes - UNSHARDED_PASSES if sharded else passes


def apply_kernels(model, cfg: Config, compute_dtype: str, device, sharded: bool) -> Set[str]:
    """Swap the twins of kernel_libraries' choice into the built model, then the device's (device_passes) into the
    cells the kernels left plain (adapters/twins.py overlay); returns the passes applied."""
    from adapters.twins import overlay

    libraries = kernel_libraries(cfg, compute_dtype, device, sharded)
    if libraries:
        import models.llama.kernels  # noqa: F401  (registers the twins)

        overlay(model, libraries)
    passes = device_passes(cfg, device, sharded)
    if passes:
        import models.llama.device_ops  # noqa: F401  (registers the twins)

        overlay(model, passes)
    return libraries | passes


def attention_kind(cfg: Config, device, compute_dtype: str, sharded: bool) -> str:
    """flash (Ascend's flash attention), fused (kernels/attention.cc) or plain (MindSpore ops): what build and
    apply_kernels give this config; the dry-run planner reads it (no [S, S] probabilities kept unless plain)."""
    if use_flash_attention(cfg, device):
        return "flash"
    return "fused" if "attention" in kernel_libraries(cfg, compute_dtype, device, sharded) else "plain"


def export_mindformers(cfg, weights: dict, out_dir: str, location=None) -> None:
    """A MindFormers .ckpt and run YAML of a checkpoint's config and weights (models/llama/mindformers.py); `location`:
    where out_dir will be once in place, for the YAML's load_checkpoint."""
    from models.llama.mindformers import export_checkpoint

    export_checkpoint(cfg, weights, out_dir, location)


def recompute_cells(model, mode: str) -> list:
    """full: each decoder layer; selective: only the attention core's scores/softmax block (each query block
    when model.attention_chunk is set), or flash attention's core. The fused kernel keeps no scores: selective has
    nothing to redo there."""
    from models.llama.model import CoreAttention, FlashCoreAttention

    if mode == "full":
        return list(model.layers())
    cores = [layer.attention.core for layer in model.layers()]
    return [getattr(core, "block", core) for core in cores if isinstance(core, (CoreAttention, FlashCoreAttention))]


def check(cfg) -> None:
    """Rules of this family's keys (base/validate.py calls it; each failure names the key)."""
    m = cfg.model
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
        require(m[key] > 0, f"model.{key}", f"must be positive, got {m[key]}")
    require(m.impl in ("native", "mindformers"), "model.impl", f"got {m.impl!r}; choose one of native, mindformers")
    check_rope_scaling(m)
    require(m.attention_chunk >= 0, "model.attention_chunk", f"must be >= 0 (0: off), got {m.attention_chunk}")
    require(not (m.attention_chunk and m.flash_attention), "model.attention_chunk",
            "flash attention already works in blocks; set model.attention_chunk=0 or model.flash_attention=false")
    check_flash_precision(cfg)
    p = cfg.parallel
    import kernels

    kernels.switched_off()  # an unknown MINDLAB_KERNELS is refused before anything is built
    for kind, library in (("attention_kernel", "attention"), ("layer_kernels", "layers")):
        require(m[kind] in ("auto", "fused", "plain"), f"model.{kind}", f"got {m[kind]!r}; choose one of auto, fused, plain")
        if m[kind] != "fused":
            continue
        rules = ((m.impl == "native", "model.impl", "is the native model's"),
                 (cfg.device.cpu_kernels, "device", "runs on CPU (device.cpu_kernels)"),
                 (cfg.precision.compute_dtype == "fp32", "precision.compute_dtype", "computes in fp32"),
                 (p.tp == p.pp == 1, "parallel", "has no tensor/pipeline sharding plan"))
        if kind == "attention_kernel":
            rules += ((not m.flash_attention, "model.flash_attention", "replaces flash attention on CPU"),
                      (not m.attention_chunk, "model.attention_chunk", "already works in blocks of query rows"))
        for ok, key, why in rules:
            require(ok, key, f"model.{kind}=fused {why}; set model.{kind}=auto or plain")
        path, why = kernels.library(library)
        require(path is not None, f"model.{kind}", f"fused: {why}; or set model.{kind}=plain")
    check_attention_shape(m)
    for key in ("num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
        require(m[key] % p.tp == 0, "parallel.tp", f"tp={p.tp} does not divide model.{key}={m[key]}")


def check_flash_precision(cfg) -> None:
    """Flash attention computes in fp16/bf16: MindSpore documents `FlashAttentionScore` for those inputs only
    (some newer CANN kernels also take fp32, far slower). Checked in the dry run too, so a plan never says
    "compute fp32 ... attention flash"."""
    m, device = cfg.model, cfg.device
    if cfg.precision.compute_dtype != "fp32" or not device.flash_attention or not use_flash_attention(m, device):
        return  # (elsewhere flash attention is refused for having no kernel: base/validate.py)
    how = "null: on by default on " + device.target if m.flash_attention is None else str(m.flash_attention).lower()
    raise ConfigError("precision", f"fp32 with flash attention (model.flash_attention={how}): flash attention takes "
                      f"fp16/bf16 inputs only; use precision=auto ({device.compute_dtype} on device={device.name}) or "
                      "precision=fp16|bf16, or set model.flash_attention=false for attention in fp32")


def check_rope_scaling(m) -> None:
    """model.rope_scaling: a known type, a factor > 1 for a scaling (1 without), YaRN / llama3 in range."""
    s = m.rope_scaling
    require(s.type in rope.TYPES, "model.rope_scaling.type", f"got {s.type!r}; choose one of {', '.join(rope.TYPES)}")
    if s.type == "none":
        require(s.factor == 1.0, "model.rope_scaling.factor",
                f"{s.factor} does nothing with type=none; set model.rope_scaling.type "
                f"({', '.join(rope.TYPES[1:])}) or factor=1")
        return
    require(s.factor > 1.0, "model.rope_scaling.factor",
            f"must be > 1 for type={s.type} (the context extension ratio), got {s.factor}")
    require(m.impl == "native" or s.type in ("linear", "ntk"), "model.rope_scaling.type",
            f"{s.type} is implemented by the native Llama only; use model.impl=native (or type linear / ntk)")
    if s.type == "yarn":
        require(s.beta_slow > 0, "model.rope_scaling.beta_slow", f"must be > 0, got {s.beta_slow}")
        require(s.beta_fast > s.beta_slow, "model.rope_scaling.beta_fast",
                f"must be > beta_slow={s.beta_slow} (rotations: extrapolate above beta_fast, interpolate below "
                f"beta_slow), got {s.beta_fast}")
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            require(s[key] is None or s[key] > 0, f"model.rope_scaling.{key}", f"must be > 0 or null, got {s[key]}")
    if s.type == "llama3":
        require(0 < s.low_freq_factor < s.high_freq_factor, "model.rope_scaling.low_freq_factor",
                f"need 0 < low_freq_factor < high_freq_factor, got {s.low_freq_factor} and {s.high_freq_factor}")


def describe(m, count) -> list:
    """Dry-run lines: the shape and where the parameters are (`count` formats a number)."""
    c = parameter_count(m)
    return [f"  vocab {m.vocab_size}, hidden {m.hidden_size}, {m.num_layers} layers, {m.num_heads} heads "
            f"({m.num_kv_heads} kv, head dim {m.hidden_size // m.num_heads}), ffn {m.intermediate_size}",
            f"  embedding   {count(c['embedding'])}",
            f"  layers      {count(c['layers'])} = {m.num_layers} x {count(c['per_layer'])}",
            f"  final norm  {count(c['final_norm'])}",
            f"  lm head     {'tied to the embedding' if m.tie_embeddings else count(c['lm_head'])}"]


def generator(model):
    """The model's generator (generation.py: a KV cache in two compiled graphs), made once and kept on it."""
    from models.common.generation import generator as llama_generator

    return llama_generator(model)


def context_window(m) -> int:
    """The longest sequence the model serves: max_position_embeddings, widened by model.rope_scaling."""
    return rope.window(m)


def set_context_length(model, length: int) -> None:
    """Dynamic NTK's tables for rows of `length` tokens (rope.py); evaluation calls it per context length."""
    model.model.set_rope_length(length)
