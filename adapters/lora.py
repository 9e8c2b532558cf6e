"""LoRA (Hu et al. 2021) for mindlab's own Linear cells, applied to a built model as a converter (torchtitan's
model-converter style): the model's code is untouched, `apply_lora` rewrites the built cell tree. The PEFT method
`peft=lora` (base/peft.py's contract): `check`, `apply`, `merge`, `export` and `adapter_parameters` below.

    adapters = apply(model, cfg)                   # the trainer: after build_model, before the optimizer is built
    info = apply_lora(model, cfg.peft, seed)       # the same, by hand
    print(describe(info))                          # model=tiny: "LoRA: 74,752 trainable / 1,861,760 total (4.02%) ..."
    optimizer = build_optimizer(model.trainable_params(), ...)      # the adapters only
    merged = merge_lora(weights, cfg.peft)         # a checkpoint's weights -> plain base weights
    tensors, config = peft_adapter_files(lora_state(model), cfg.peft, single_name(llama.hf.to_hf), "hf_dir")
    write_peft_adapter("out/adapter", tensors, config)   # loads with peft.PeftModel.from_pretrained

A targeted linear cell (y = x W^T (+ b), W [out, in]) then computes

    y = x W^T (+ b) + scaling * (dropout(x) A^T) B^T       A [r, in] Kaiming-uniform, B [out, r] zeros

so the model is unchanged until B is trained; scaling = alpha / r, or alpha / sqrt(r) with `use_rslora`
(Kalajdzievski 2023). The branch has no bias and runs in the base cell's `compute_dtype` (fp16 when the base
does); dropout acts only in training mode. A is drawn with NumPy from (seed, crc32(cell path)): identical on
every rank, and independent of which other cells are targeted. Initialisation follows PEFT:
`kaiming_uniform_(A, a=sqrt(5))`, i.e. U(-1/sqrt(in), 1/sqrt(in)).

Which cells: a "linear cell" is one with its own 2-D `weight` Parameter [out, in], a `compute_dtype` and a
`matmul` primitive `MatMul(transpose_b=True)` (models/llama/model.py `Linear`, models/bert/model.py `Linear`,
which adds a bias; embeddings are not, as they have no matmul). `target_modules` follows PEFT: a name matches
the cell whose path equals it or ends with "." + name; an entry "re:<regex>" matches paths by `re.fullmatch`.
Unset (null), the model's family says which (its LORA_TARGETS, base/family.py; a family's model class names its
family in `family`): a family without them makes the run name the cells.

Construction and names: the targeted cell is replaced in its parent by its twin (adapters/twins.py says why a
twin), a cell of a subclass of its own class (`LoraMixin` + e.g. llama `Linear` = `LoraLinear`) that shares its
Parameters, primitives and attributes and whose `construct` is the base class's plus the LoRA branch. The base
names stay exactly as they were (`model.layers.0.attention.wq.weight`), the adapters are named from them
(`model.layers.0.attention.wq.lora_A.weight` / `.lora_B.weight`), and the tensor-parallel plan's strategies and
recompute still apply to the base matmul, and the adapters follow the base's split by the rules this module
registers with adapters/sharding.py: on a column-parallel linear B [out, r] is split by rows like W and A is
replicated; on a row-parallel one A [r, in] is split by columns like W (its partial products are summed by the
AllReduce MindSpore inserts) and B is replicated. Graphs MindSpore already compiled for the model's cells are dropped
from their caches (they would not see the adapters); a cell compiled around the model (a loss or train-step
cell) cannot be reached from here: build those after apply_lora.

Importing this module is cheap (no MindSpore): `LoraConfig` is a config-group schema.
"""
import functools
import math
import re
import zlib
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from adapters import sharding
from base.errors import ConfigError, require
from base.peft import Adapters
from base.registry import FAMILIES

LORA_A, LORA_B = "lora_A.weight", "lora_B.weight"  # parameter name suffixes, as in PEFT's state dicts
# the adapters' matmuls from their base's ((tokens, k), (out, k)): A [r, in] splits `in` as W, B [out, r] `out`
sharding.follow("lora_A", lambda base: (base[0], (1, base[1][1])))
sharding.follow("lora_B", lambda base: ((base[0][0], 1), (base[1][0], 1)))


@dataclass
class LoraConfig:
    name: str = "lora"  # the preset's name
    r: int = 8  # rank of the update B @ A (A [r, in], B [out, r])
    alpha: float = 16.0  # the update is scaled by alpha / r (alpha / sqrt(r) with use_rslora)
    dropout: float = 0.0  # dropout on the LoRA branch's input, training mode only; 0.0 builds no dropout op
    # cells to adapt, PEFT's matching: a name matches the cell whose path equals it or ends with "." + name;
    # an entry "re:<regex>" matches whole cell paths (re.fullmatch). null: the model family's LORA_TARGETS
    target_modules: Optional[List[str]] = None
    use_rslora: bool = False  # rank-stabilized LoRA: scaling alpha / sqrt(r) instead of alpha / r

    @staticmethod
    def adapter_parameters(linears: Dict[str, Tuple[int, int]], cfg, default_targets: Sequence[str] = ()) -> int:
        """The LoRA parameters `cfg` adds to a model whose linear cells are `linears` (path -> (in, out)): r x
        (in + out) for each one target_modules (null: `default_targets`, the family's) matches. The dry run's memory
        plan asks each PEFT method this through base/registry.py (only these train)."""
        matches = _matcher(_spec(cfg.target_modules, default_targets))
        return sum(cfg.r * (n_in + n_out) for path, (n_in, n_out) in linears.items() if matches(path))


Config = LoraConfig
adapter_parameters = LoraConfig.adapter_parameters


def check(cfg) -> None:
    """peft=lora's rules, before anything is built: its numbers, and cells to adapt (named, or the family's)."""
    lora = cfg.peft
    require(lora.r >= 1, "peft.r", f"must be >= 1, got {lora.r}")
    require(lora.alpha > 0, "peft.alpha", f"must be > 0, got {lora.alpha}")
    require(0 <= lora.dropout < 1, "peft.dropout", f"must be in [0, 1), got {lora.dropout}")
    require(lora.target_modules is not None or FAMILIES[cfg.model.family].LORA_TARGETS is not None,
            "peft.target_modules", f"model family {cfg.model.family} declares no default LoRA targets "
            "(LORA_TARGETS); name the cells to adapt, e.g. peft.target_modules=[attention.self.query]")


def apply(model, cfg) -> Adapters:
    """LoRA on the built `model` as cfg.peft says (seed cfg.trainer.seed), the base frozen; what its checkpoints
    hold: the adapters, and the adapter_config.json that names cfg.stage.init_from as their base."""
    try:
        info = apply_lora(model, cfg.peft, cfg.trainer.seed)
    except ValueError as err:
        raise ConfigError("peft.target_modules", str(err).removeprefix("peft.target_modules=")) from None
    weights = lora_state(model)
    _, adapter_config = peft_adapter_files(weights, cfg.peft, single_name(FAMILIES[cfg.model.family].hf.to_hf),
                                           cfg.stage.init_from or "")
    return Adapters(set(weights), adapter_config, describe(info))


def _spec(target_modules, default_targets: Sequence[str]) -> List[str]:
    """target_modules as a list of entries (a single string is one entry); null: `default_targets`."""
    if target_modules is None:
        return list(default_targets)
    return [target_modules] if isinstance(target_modules, str) else [str(t) for t in target_modules]


def scaling(cfg) -> float:
    """The factor on B @ A: alpha / r, or alpha / sqrt(r) with use_rslora."""
    return float(cfg.alpha) / (math.sqrt(cfg.r) if cfg.use_rslora else float(cfg.r))


def is_lora_name(name: str) -> bool:
    return name.endswith(("." + LORA_A, "." + LORA_B))


def _matcher(entries: List[str]) -> Callable[[str], bool]:
    regexes = [re.compile(e[len("re:"):]) for e in entries if e.startswith("re:")]
    names = [e for e in entries if not e.startswith("re:")]
    return lambda path: (any(path == n or path.endswith("." + n) for n in names)
                         or any(r.fullmatch(path) for r in regexes))


def _suffix_pattern(path: str) -> str:
    """A cell path without its layer: `model.layers.7.attention.wq` -> `attention.wq` (others as they are)."""
    return re.sub(r"^(.*\.)?\d+\.", "", path)


def _is_linear(cell) -> bool:
    from mindspore import Parameter, ops

    weight, matmul = cell._params.get("weight"), getattr(cell, "matmul", None)  # pylint: disable=protected-access
    return (isinstance(weight, Parameter) and len(weight.shape) == 2 and hasattr(cell, "compute_dtype")
            and isinstance(matmul, ops.MatMul) and bool(matmul.transpose_b))


@functools.lru_cache(maxsize=None)
def _cells():
    """The cell classes (built on first use, so that importing this module does not import MindSpore)."""
    from mindspore import Parameter, Tensor, nn, ops

    from adapters.twins import adopt

    class LoraProjection(nn.Cell):
        """x @ W^T, W [out, in] (lora_A [r, in] or lora_B [out, r]); x is already in `compute_dtype`."""

        def __init__(self, weight: np.ndarray, compute_dtype):
            super().__init__()
            self.weight = Parameter(Tensor(weight))
            self.compute_dtype = compute_dtype
            self.matmul = ops.MatMul(transpose_b=True)

        def construct(self, x):
            return self.matmul(x, self.weight.astype(self.compute_dtype))

    class LoraMixin(nn.Cell):
        """Mixed in before a linear cell's class: that class's construct plus scaling * B(A(dropout(x)))."""

        def __init__(self, base: nn.Cell, a: np.ndarray, b: np.ndarray, scale: float, dropout: float):
            adopt(self, base)  # base's weight, matmul and compute_dtype: the same objects
            prefix = base.weight.name[: -len("weight")]  # e.g. "model.layers.0.attention.wq."
            self.lora_dropout = nn.Dropout(p=dropout) if dropout > 0 else nn.Identity()
            self.lora_A = LoraProjection(a, self.compute_dtype)
            self.lora_B = LoraProjection(b, self.compute_dtype)
            self.lora_A.weight.name, self.lora_B.weight.name = prefix + LORA_A, prefix + LORA_B
            self.scaling = scale

        def construct(self, x):
            # the base class's x @ W^T (+ b) in compute_dtype; graph mode reads a bare super() as
            # super(type(self), self), which would be this method again
            y = super(LoraMixin, self).construct(x)
            shape = x.shape
            h = self.lora_dropout(x.reshape(-1, shape[-1]).astype(self.compute_dtype))
            h = self.lora_B(self.lora_A(h)) * self.scaling
            return y + h.reshape(shape[:-1] + (-1,)).astype(y.dtype)

    return LoraProjection, LoraMixin


@functools.lru_cache(maxsize=None)
def _lora_class(base_cls: type) -> type:
    """`Lora<Base>`: LoraMixin first in the MRO, so its construct's super() is the base class's construct."""
    return type(f"Lora{base_cls.__name__}", (_cells()[1], base_cls), {"__module__": __name__})


def apply_lora(model, cfg, seed: int) -> dict:
    """Add LoRA to every linear cell of `model` that `cfg.target_modules` matches and freeze everything else
    (`requires_grad = False`), so `model.trainable_params()` are the adapters. Returns
    {"trainable": adapter parameter count, "total": all parameters, "targets": the adapted cell paths}."""
    from adapters.twins import drop_compiled, replace

    r, dropout = int(cfg.r), float(cfg.dropout)
    if r <= 0:
        raise ValueError(f"peft.r must be positive, got {cfg.r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"peft.dropout must be in [0, 1), got {cfg.dropout}")
    lora_mixin = _cells()[1]
    cells = dict(model.cells_and_names())
    linear = [path for path, cell in cells.items() if path and _is_linear(cell)]
    available = ", ".join(dict.fromkeys(_suffix_pattern(p) for p in linear))
    family = getattr(model, "family", None)  # the model class's family
    defaults = FAMILIES[family].LORA_TARGETS if family in FAMILIES else None
    if cfg.target_modules is None and defaults is None:
        raise ValueError(f"peft.target_modules=null: model family {family} declares no default LoRA targets "
                         f"(LORA_TARGETS); name the cells to adapt, its linear cells are: {available}")
    spec = _spec(cfg.target_modules, defaults)
    match = _matcher(spec)
    targets = [path for path in linear if match(path)]
    if not targets:
        raise ValueError(f"peft.target_modules={spec} matches no linear cell of "
                         f"{type(model).__name__}; its linear cells are: {available} (a name matches the cell "
                         "path equal to it or ending in '.' + name; 're:<regex>' matches whole paths)")
    adapters = []
    for path in targets:
        base = cells[path]
        if isinstance(base, lora_mixin):
            raise ValueError(f"{path} already has LoRA (apply_lora was called twice)")
        out_features, in_features = base.weight.shape
        rng = np.random.default_rng([seed, zlib.crc32(path.encode())])
        bound = 1.0 / math.sqrt(in_features)  # kaiming_uniform_(a=sqrt(5)) on A [r, in]
        a = rng.uniform(-bound, bound, (r, in_features)).astype(np.float32)
        b = np.zeros((out_features, r), np.float32)
        cell = _lora_class(type(base))(base, a, b, scaling(cfg), dropout)
        replace(model, path, cell)
        adapters += [cell.lora_A.weight, cell.lora_B.weight]
    drop_compiled(model)  # graphs compiled for the old cells: the next call recompiles
    trainable = {id(p) for p in adapters}
    params = model.get_parameters()
    total = 0
    for p in params:
        p.requires_grad = id(p) in trainable
        total += p.size
    return {"trainable": sum(p.size for p in adapters), "total": total, "targets": targets}


def describe(info: dict) -> str:
    """The line a caller prints after apply_lora (the trainer: Adapters.summary)."""
    t, n = info["trainable"], info["total"]
    return (f"LoRA: {t:,} trainable / {n:,} total ({100.0 * t / n:.2f}%) in {len(info['targets'])} cells "
            f"({', '.join(dict.fromkeys(_suffix_pattern(p) for p in info['targets']))})")


def lora_state(model) -> Dict[str, np.ndarray]:
    """The adapters' weights by parameter name (what an adapter checkpoint or a PEFT export needs)."""
    return {p.name: p.asnumpy() for p in model.get_parameters() if is_lora_name(p.name)}


def merge_lora(weights: Dict[str, np.ndarray], cfg) -> Dict[str, np.ndarray]:
    """Base weights with every adapter merged in (W += scaling * B @ A, in float64, stored in W's dtype) and the
    lora tensors dropped; `weights` (a checkpoint's dict) is not modified."""
    s = scaling(cfg)
    merged = {k: v for k, v in weights.items() if not is_lora_name(k)}
    for name in weights:
        if not name.endswith("." + LORA_A):
            continue
        prefix = name[: -len(LORA_A)]
        base, b_name = prefix + "weight", prefix + LORA_B
        if b_name not in weights or base not in merged:
            raise ValueError(f"{name}: {b_name if b_name not in weights else base} is missing")
        a, b, w = weights[name], weights[b_name], merged[base]
        if a.shape[0] != cfg.r or b.shape != (w.shape[0], a.shape[0]) or a.shape[1] != w.shape[1]:
            raise ValueError(f"{prefix[:-1]}: A {a.shape}, B {b.shape} and W {w.shape} do not fit peft.r={cfg.r}")
        delta = b.astype(np.float64) @ a.astype(np.float64)
        merged[base] = (w.astype(np.float64) + s * delta).astype(w.dtype)
    orphans = [k for k in weights if k.endswith("." + LORA_B) and k[: -len(LORA_B)] + LORA_A not in weights]
    if orphans:
        raise ValueError(f"{orphans[0]} has no {LORA_A}")
    return merged


def single_name(to_hf: Callable[[dict], dict]) -> Callable[[str], str]:
    """A parameter-name renamer from a family's dict converter (`models.llama.hf.to_hf`), applied to one name."""
    return lambda name: next(iter(to_hf({name: None})))


def peft_adapter_files(lora_weights: Dict[str, np.ndarray], cfg, hf_rename: Callable[[str], str],
                       base_model_name_or_path: str, task_type: str = "CAUSAL_LM") -> Tuple[dict, dict]:
    """(adapter_model.safetensors tensors, adapter_config.json) in PEFT's LoRA format. `hf_rename` maps a base
    weight name of ours (`model.layers.0.attention.wq.weight`) to Hugging Face's
    (`model.layers.0.self_attn.q_proj.weight`); tensors are named `base_model.model.<hf module>.lora_A.weight`.
    target_modules are the HF module suffixes (q_proj, ...), which PEFT matches in every layer: a module whose
    adapter was not exported keeps PEFT's B = 0, i.e. is unchanged."""
    tensors, suffixes = {}, []
    for name, value in lora_weights.items():
        if not is_lora_name(name):
            raise ValueError(f"{name} is not a LoRA weight (…{LORA_A} / …{LORA_B})")
        prefix, kind = name[: -len(LORA_A)], name[-len(LORA_A):]
        hf_weight = hf_rename(prefix + "weight")
        if not hf_weight.endswith(".weight"):
            raise ValueError(f"{prefix}weight renames to {hf_weight!r}, not a module's .weight")
        module = hf_weight[: -len(".weight")]
        tensors[f"base_model.model.{module}.{kind}"] = np.ascontiguousarray(value)
        suffixes.append(module.rsplit(".", 1)[-1])
    config = {
        "peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
        "r": int(cfg.r), "lora_alpha": float(cfg.alpha), "lora_dropout": float(cfg.dropout),
        "use_rslora": bool(cfg.use_rslora), "target_modules": sorted(set(suffixes)), "bias": "none",
        "fan_in_fan_out": False, "init_lora_weights": True, "modules_to_save": None, "inference_mode": True,
    }
    return tensors, config


def write_peft_adapter(out_dir: str, tensors: dict, config: dict) -> None:
    """adapter_model.safetensors + adapter_config.json: a directory `peft.PeftModel.from_pretrained` loads."""
    import json
    import os

    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "adapter_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


merge = merge_lora


def export(weights: Dict[str, np.ndarray], cfg, to_hf: Callable[[dict], dict], base_model_dir: str,
           out_dir: str) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter directory on the Hugging Face model at `base_model_dir`;
    `to_hf`: the family's state-dict renamer (its hf.to_hf)."""
    write_peft_adapter(out_dir, *peft_adapter_files(weights, cfg, single_name(to_hf), base_model_dir))
