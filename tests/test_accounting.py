"""Parameter and FLOP accounting (models/llama/accounting.py) against published and hand-computed numbers."""
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from models.llama.config import LlamaConfig as ModelConfig
from models.llama.accounting import flops_per_token, matmul_parameter_count, parameter_count

CONF = Path(__file__).resolve().parents[1] / "conf"


def load_model(name: str, **overrides):
    preset = OmegaConf.load(CONF / "model" / f"{name}.yaml")
    preset.pop("defaults")
    return OmegaConf.merge(OmegaConf.structured(ModelConfig), preset, overrides)


@pytest.mark.parametrize("name, total", [
    ("7b", 6_738_415_616),
    ("13b", 13_015_864_320),
    ("70b", 68_976_648_192),
])
def test_llama2_parameter_counts(name, total):
    assert parameter_count(load_model(name))["total"] == total


def test_components_of_tiny_by_hand():
    # V=4096 h=128 L=4 heads=4 kv=2 (head_dim 32, kv_dim 64) ffn=352
    counts = parameter_count(load_model("tiny"))
    per_layer = 128 + (128 * 128 + 2 * 128 * 64 + 128 * 128) + 128 + 3 * 128 * 352
    assert counts == {
        "embedding": 4096 * 128,
        "per_layer": per_layer,
        "layers": 4 * per_layer,
        "final_norm": 128,
        "lm_head": 4096 * 128,
        "total": 1_787_008,
    }
    assert counts["per_layer"] == 184_576


def test_tied_embeddings_drop_the_head():
    counts = parameter_count(load_model("tiny", tie_embeddings=True))
    assert counts["lm_head"] == 0
    assert counts["total"] == 1_787_008 - 4096 * 128


SMALL = SimpleNamespace(vocab_size=10, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        intermediate_size=12, tie_embeddings=False)


def test_flops_small_case_by_hand():
    # per layer: wq, wo 8*8; wk, wv 8*4 (1 kv head of dim 4); SwiGLU 3*8*12 -> 480; 2 layers + head 10*8
    assert matmul_parameter_count(SMALL) == 2 * (2 * 64 + 2 * 32 + 288) + 80 == 1040
    attention = 12 * 2 * 2 * 4 * 16  # 12 * L * heads * head_dim * seq_len = 3072
    assert flops_per_token(SMALL, seq_len=16) == 6 * 1040 + attention == 9312


def test_flops_tied_head_still_a_matmul():
    tied = SimpleNamespace(**{**vars(SMALL), "tie_embeddings": True})
    assert flops_per_token(tied, 16) == flops_per_token(SMALL, 16)


def test_flops_7b():
    m = load_model("7b")
    n_matmul = 32 * (4 * 4096 ** 2 + 3 * 4096 * 11008) + 32000 * 4096
    assert matmul_parameter_count(m) == n_matmul == 6_607_077_376
    assert flops_per_token(m, 4096) == 6 * n_matmul + 12 * 32 * 32 * 128 * 4096 == 46_084_915_200
    # at short context the total is close to the familiar 6 * (all parameters)
    assert flops_per_token(m, 256) == pytest.approx(6 * 6_738_415_616, rel=0.01)
