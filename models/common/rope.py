"""RoPE frequencies and their long-context scalings, in NumPy (no MindSpore: the dry run and hf.py use it).

Every method extends a model pretrained at `original` positions (mindlab's `model.max_position_embeddings`) to
a window of `original x factor` positions, by changing the rotary inverse frequencies (and, for YaRN, the
size of cos/sin). The formulas and their float32 arithmetic follow transformers 4.57
`modeling_rope_utils.py` step by step, so the tables equal the ones `LlamaForCausalLM` builds from the
exported `rope_scaling` (tests/test_rope.py compares them; MindFormers' `FreqsMgr` has the same methods):

  linear   position interpolation (Chen et al. 2023): every frequency / factor.
  ntk      "NTK-aware" (bloc97 2023): base theta -> theta * factor^(d/(d-2)); high frequencies barely move,
           the lowest is slowed by the factor. Exported to HF as the raised rope_theta (the same function).
  dynamic  dynamic NTK (emozilla 2023): the NTK base for the *current* length L > original,
           theta * (factor L / original - (factor - 1))^(d/(d-2)); identity up to `original`. The tables
           depend on L, so LlamaModel.set_rope_length(L) rebuilds them: in training L = data.seq_len (one
           fixed table per run); in generation L = prompt + max_new_tokens (one table for the whole cache).
  yarn     YaRN (Peng et al. 2023): per frequency a linear ramp between interpolation (wavelengths longer
           than original / beta_slow rotations) and extrapolation (more than beta_fast rotations), and an
           attention temperature: cos/sin times 0.1 ln(factor) + 1 (`attention_factor`, or mscale /
           mscale_all_dim as in DeepSeek-V2), i.e. logits times its square.
  llama3   Llama 3.1's frequency bands: wavelengths above original / low_freq_factor are interpolated,
           below original / high_freq_factor kept, a smooth blend between.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

TYPES = ("none", "linear", "ntk", "dynamic", "yarn", "llama3")


@dataclass
class RopeScalingConfig:
    """Long-context RoPE scaling (this file has the formulas): the model was pretrained at
    max_position_embeddings positions and serves max_position_embeddings x factor."""
    type: str = "none"  # none | linear | ntk (fixed NTK-aware) | dynamic (dynamic NTK) | yarn | llama3
    factor: float = 1.0  # context extension ratio; > 1 for every type but none
    # yarn: ramp between extrapolation (> beta_fast rotations in the original window) and interpolation
    # (< beta_slow rotations); attention temperature: attention_factor, else from mscale / mscale_all_dim
    # (both set, DeepSeek-V2 style), else 0.1 ln(factor) + 1. truncate: integer ramp bounds (the paper's code).
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    truncate: bool = True
    # llama3: wavelengths above max_position_embeddings / low_freq_factor are interpolated, below
    # max_position_embeddings / high_freq_factor kept (Llama 3.1: factor 8, 1, 4)
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0


F32 = np.float32


def window(m) -> int:
    """Positions the model serves: max_position_embeddings, times the factor when RoPE is scaled."""
    if m.rope_scaling.type == "none":
        return int(m.max_position_embeddings)
    return int(m.max_position_embeddings * m.rope_scaling.factor)


def _powers(theta: float, head_dim: int) -> np.ndarray:
    """theta^(2i/d) in float32, correctly rounded (as torch's float32 pow; NumPy's is an ulp off at times)."""
    exponents = (np.arange(0, head_dim, 2).astype(F32) / F32(head_dim)).astype(np.float64)
    return (np.float64(F32(theta)) ** exponents).astype(F32)


def _default(head_dim: int, theta: float) -> np.ndarray:
    return (F32(1.0) / _powers(theta, head_dim)).astype(F32)


def _yarn(head_dim: int, theta: float, s, original: int) -> Tuple[np.ndarray, float]:
    factor = s.factor

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = s.attention_factor
    if attention is None:
        attention = get_mscale(factor, s.mscale) / get_mscale(factor, s.mscale_all_dim) \
            if s.mscale and s.mscale_all_dim else get_mscale(factor)

    def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times into `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = _powers(theta, head_dim)
    extrapolation, interpolation = F32(1.0) / pos_freqs, F32(1.0) / (F32(factor) * pos_freqs)
    ramp = np.clip((np.arange(head_dim // 2, dtype=F32) - F32(low)) / F32(high - low), 0, 1).astype(F32)
    keep = F32(1) - ramp  # 1: extrapolate (high frequency, unchanged), 0: interpolate (divide by factor)
    return (interpolation * (F32(1) - keep) + extrapolation * keep).astype(F32), float(attention)


def _llama3(head_dim: int, theta: float, s, original: int) -> np.ndarray:
    inv = _default(head_dim, theta)
    factor, low_f, high_f = F32(s.factor), F32(s.low_freq_factor), F32(s.high_freq_factor)
    low_wavelen, high_wavelen = F32(original) / low_f, F32(original) / high_f
    wavelen = F32(2 * math.pi) / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv).astype(F32)
    smooth = ((F32(original) / wavelen - low_f) / (high_f - low_f)).astype(F32)
    smoothed = ((F32(1) - smooth) * scaled / factor + smooth * scaled).astype(F32)
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(F32)


def inv_freq(head_dim: int, theta: float, s, original: int, length: Optional[int] = None) -> Tuple[np.ndarray, float]:
    """(inverse frequencies [head_dim / 2] float32, attention factor applied to cos and sin) for the
    scaling `s` (a RopeScalingConfig); `length` is the current length, used by dynamic NTK only."""
    t, d = s.type, head_dim
    if t in ("none", "linear"):
        inv = _default(d, theta)
        return (inv / F32(s.factor) if t == "linear" else inv), 1.0
    if t == "ntk":
        return _default(d, theta * s.factor ** (d / (d - 2))), 1.0
    if t == "dynamic":
        length = max(length or original, original)
        stretch = F32(s.factor) * F32(length) / F32(original) - F32(s.factor - 1)
        base = F32(theta) * F32(np.float64(stretch) ** (d / (d - 2)))
        return _default(d, float(base)), 1.0
    if t == "yarn":
        return _yarn(d, theta, s, original)
    if t == "llama3":
        return _llama3(d, theta, s, original), 1.0
    raise ValueError(f"unknown RoPE scaling type {t!r}; choose one of {', '.join(TYPES)}")


def tables(head_dim: int, rows: int, theta: float, s, original: int, length: Optional[int] = None):
    """cos, sin [rows, head_dim] float32 ("rotate half" layout: the frequencies twice), scaled by the
    attention factor; angles are float32 products as in transformers' rotary embedding."""
    inv, attention = inv_freq(head_dim, theta, s, original, length)
    angles = np.outer(np.arange(rows, dtype=F32), inv).astype(F32)
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    return (np.cos(angles) * attention).astype(F32), (np.sin(angles) * attention).astype(F32)


def ntk_theta(m) -> float:
    """The raised base of fixed NTK scaling (hf.py exports it as rope_theta)."""
    d = m.hidden_size // m.num_heads
    return m.rope_theta * m.rope_scaling.factor ** (d / (d - 2))
