"""RoPE scaling (models/common/rope.py): the cos/sin tables equal transformers' LlamaRotaryEmbedding for the
exported `rope_scaling`, each method's defining property holds, and bad settings give one clear error."""
import numpy as np
import pytest
from omegaconf import OmegaConf

from conftest import compose_cfg, load_preset
from base.errors import ConfigError
from base.validate import validate
from models.llama import hf, rope
from models.llama.model import rope_tables

SCALINGS = {
    "linear": {"type": "linear", "factor": 4.0},
    "ntk": {"type": "ntk", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 4.0},
    "yarn": {"type": "yarn", "factor": 8.0},
    "yarn_mscale": {"type": "yarn", "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707,
                    "mscale_all_dim": 1.0, "truncate": False},
    "llama3": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
}


def model_cfg(scaling, original=256):
    return OmegaConf.merge(load_preset("model", "tiny"), {"max_position_embeddings": original,
                                                          "rope_scaling": scaling})


def hf_tables(m, length):
    """transformers' cos/sin for positions 0..length-1 of the config we export (as LlamaForCausalLM runs)."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(LlamaConfig(**hf.hf_config(m)))
    x = torch.zeros(1, length, 4, dtype=torch.float32)
    cos, sin = rotary(x, torch.arange(length)[None])
    return cos[0].numpy(), sin[0].numpy()


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [200, 1024])  # inside and 4x past the pretrained 256 positions
def test_tables_equal_transformers(name, length):
    m = model_cfg(SCALINGS[name])
    cos, sin = rope_tables(m, length)
    theirs_cos, theirs_sin = hf_tables(m, length)
    np.testing.assert_allclose(cos[:length], theirs_cos, atol=1e-6)
    np.testing.assert_allclose(sin[:length], theirs_sin, atol=1e-6)


def test_hf_config_round_trips():
    for name, scaling in SCALINGS.items():
        if name == "ntk":  # exported as a raised rope_theta: same tables, no rope_scaling
            continue
        m = model_cfg(scaling)
        back = OmegaConf.merge(load_preset("model", "tiny"), hf.config_from_hf(hf.hf_config(m), "config.json"))
        assert back.max_position_embeddings == 256 and back.rope_scaling == m.rope_scaling, name


def test_method_properties():
    none = model_cfg({"type": "none"})
    cos, _ = rope_tables(none)
    lin, _ = rope_tables(model_cfg(SCALINGS["linear"]))
    assert lin.shape[0] == 1024 and cos.shape[0] == 256  # window = original x factor
    np.testing.assert_allclose(lin[::4][:256], cos, atol=1e-5)  # position 4p scaled == position p
    ntk, _ = rope_tables(model_cfg(SCALINGS["ntk"]))
    np.testing.assert_allclose(ntk[:256, 0], cos[:, 0], atol=1e-6)  # highest frequency untouched
    dyn = model_cfg(SCALINGS["dynamic"])
    np.testing.assert_array_equal(rope_tables(dyn, 256)[0][:256], cos)  # identity up to the pretrained length
    assert np.abs(rope_tables(dyn, 1024)[0][:256] - cos).max() > 1e-3
    yarn_inv, temperature = rope.inv_freq(32, 10000.0, model_cfg(SCALINGS["yarn"]).rope_scaling, 256)
    base_inv, _ = rope.inv_freq(32, 10000.0, none.rope_scaling, 256)
    assert temperature == pytest.approx(0.1 * np.log(8) + 1)
    assert yarn_inv[0] == base_inv[0] and yarn_inv[-1] == pytest.approx(base_inv[-1] / 8)  # ramp ends
    l3_inv, _ = rope.inv_freq(32, 10000.0, model_cfg(SCALINGS["llama3"]).rope_scaling, 256)
    wavelen = 2 * np.pi / base_inv
    np.testing.assert_allclose(l3_inv[wavelen < 64], base_inv[wavelen < 64])  # high-frequency band kept
    np.testing.assert_allclose(l3_inv[wavelen > 256], base_inv[wavelen > 256] / 8, rtol=1e-6)  # low band / factor


@pytest.mark.parametrize("overrides,key,words", [
    (["model.rope_scaling.type=yarn"], "model.rope_scaling.factor", "must be > 1 for type=yarn"),
    (["model.rope_scaling.type=linear", "model.rope_scaling.factor=0.5"], "model.rope_scaling.factor", "> 1"),
    (["model.rope_scaling.factor=4"], "model.rope_scaling.factor", "does nothing with type=none"),
    (["model.rope_scaling.type=rotary"], "model.rope_scaling.type", "choose one of none, linear, ntk, dynamic"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.beta_fast=0.5"],
     "model.rope_scaling.beta_fast", "must be > beta_slow=1.0"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.attention_factor=-1"],
     "model.rope_scaling.attention_factor", "must be > 0"),
    (["model.rope_scaling.type=llama3", "model.rope_scaling.factor=8", "model.rope_scaling.low_freq_factor=4"],
     "model.rope_scaling.low_freq_factor", "low_freq_factor < high_freq_factor"),
    (["model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.impl=mindformers"],
     "model.rope_scaling.type", "native Llama only"),
    (["model.max_position_embeddings=128", "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4",
      "data.seq_len=1024"], "data.seq_len", "128 x 4.0 = 512"),
])
def test_bad_rope_scaling_is_one_clear_error(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("model=tiny", *overrides))
    assert err.value.key == key and words in str(err.value)


def test_scaled_window_admits_longer_sequences():
    validate(compose_cfg("model=tiny", "model.max_position_embeddings=128", "model.rope_scaling.type=yarn",
                         "model.rope_scaling.factor=4", "data.seq_len=512"))


def test_long_context_stage_needs_init_from_and_sets_the_recipe():
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("stage=long_context", "model=small", "model.max_position_embeddings=256",
                             "model.rope_scaling.factor=4"))
    assert err.value.key == "stage.init_from" and "continues a trained model" in str(err.value)
    cfg = compose_cfg("stage=long_context", "stage.init_from=/ckpt/step_000300", "model=small",
                      "model.max_position_embeddings=256", "model.rope_scaling.factor=4")
    validate(cfg)
    assert (cfg.data.name, cfg.objective.packing, cfg.model.rope_scaling.type) == ("long_docs", "documents", "yarn")
    assert cfg.data.tokenizer.path == "/ckpt/step_000300/tokenizer.model" and cfg.optim.weight_decay == 0.0
    # the planner's dry run needs no checkpoint; 7b (4096 pretrained) x 8 holds 32k
    validate(compose_cfg("stage=long_context", "model=7b", "parallel=tp8pp2", "data.seq_len=32768", "device=ascend910b",
                         "nodes=2", "dry_run=true"))
