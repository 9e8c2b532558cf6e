"""Checkpoint conversion: mindlab -> Hugging Face (checked with transformers' own Llama), -> MindFormers,
and Hugging Face -> mindlab, exact both ways."""
import os

import numpy as np
import pytest
from omegaconf import OmegaConf

import mindspore as ms
from mindspore import Tensor

from conftest import load_preset
from models import build_model
from models.convert import export_hf, import_hf, main as convert_main
from base import checkpoint

pytestmark = pytest.mark.usefixtures("pynative")
TEXT = "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer"


VARIANTS = {"gqa": {}, "tied_ntk": {"tie_embeddings": True, "rope_scaling": {"type": "ntk", "factor": 4.0}},
            "linear_rope": {"rope_scaling": {"type": "linear", "factor": 2.0}}}
# long-context scalings of a model pretrained at 16 positions, run on 48 (3x past it): tests/test_rope.py
# compares the tables themselves; these the logits of the whole exported model
LONG = {"max_position_embeddings": 16}
VARIANTS.update({"dynamic_ntk": {**LONG, "rope_scaling": {"type": "dynamic", "factor": 4.0}},
                 "yarn": {**LONG, "rope_scaling": {"type": "yarn", "factor": 4.0, "beta_fast": 8.0}},
                 "llama3": {**LONG, "rope_scaling": {"type": "llama3", "factor": 4.0, "high_freq_factor": 2.0}}})


def make_checkpoint(tmp_path, tokenizer_file, variant):
    model_cfg = OmegaConf.merge(load_preset("model", "tiny"), VARIANTS[variant])
    model = build_model(model_cfg, 64, "fp32", "CPU", seed=3)
    optimizer = ms.nn.SGD(model.trainable_params())
    cfg = OmegaConf.create({"model": model_cfg, "data": {"seq_len": 64}})
    path = checkpoint.save(str(tmp_path / "ckpt"), 7, model, optimizer, {}, cfg, tokenizer_file)
    return model, model_cfg, path


def tokens(seq=48):
    return np.random.default_rng(0).integers(4, 4096, (2, seq)).astype(np.int32)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hf_export_gives_the_same_logits_in_transformers(tmp_path, tokenizer_file, variant):
    import torch
    from transformers import LlamaForCausalLM

    model, _, path = make_checkpoint(tmp_path, tokenizer_file, variant)
    export_hf(path, str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), torch_dtype=torch.float32).eval()
    x = tokens()
    model.model.set_rope_length(x.shape[1])  # dynamic NTK: the tables of this length, as transformers derives
    with torch.no_grad():
        theirs = hf(torch.tensor(x, dtype=torch.long)).logits.numpy()
    ours = model(Tensor(x)).asnumpy()
    assert np.abs(theirs - ours).max() <= 1e-4


def test_hf_tokenizer_encodes_like_ours(tmp_path, tokenizer_file):
    from transformers import LlamaTokenizer

    from data.tokenizer import Tokenizer

    _, _, path = make_checkpoint(tmp_path, tokenizer_file, "gqa")
    export_hf(path, str(tmp_path / "hf"))
    hf_tok = LlamaTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert hf_tok(TEXT)["input_ids"] == Tokenizer(tokenizer_file).encode(TEXT)
    assert (hf_tok.pad_token_id, hf_tok.eos_token_id) == (0, 3)


def test_hf_to_mindlab_to_hf_round_trips_exactly(tmp_path, tokenizer_file):
    from safetensors.numpy import load_file

    model, model_cfg, path = make_checkpoint(tmp_path, tokenizer_file, "tied_ntk")
    export_hf(path, str(tmp_path / "hf"))
    import_hf(str(tmp_path / "hf"), str(tmp_path / "back"))
    export_hf(str(tmp_path / "back"), str(tmp_path / "hf2"))
    first, second = load_file(str(tmp_path / "hf" / "model.safetensors")), \
        load_file(str(tmp_path / "hf2" / "model.safetensors"))
    assert sorted(first) == sorted(second) and all(np.array_equal(first[k], second[k]) for k in first)
    assert open(tmp_path / "hf" / "config.json").read() == open(tmp_path / "hf2" / "config.json").read()
    fresh = build_model(OmegaConf.merge(model_cfg, {"rope_scaling": {"type": "none"},
                                                    "rope_theta": OmegaConf.load(tmp_path / "back" / "config.yaml")
                                                    .model.rope_theta}), 64, "fp32", "CPU", seed=9)
    checkpoint.load_weights(str(tmp_path / "back"), fresh)  # stage.init_from=<dir> takes it
    np.testing.assert_allclose(fresh(Tensor(tokens())).asnumpy(), model(Tensor(tokens())).asnumpy(), atol=1e-5)


def test_mindformers_export_loads_into_mindformers_llama(tmp_path, tokenizer_file):
    model, model_cfg, path = make_checkpoint(tmp_path, tokenizer_file, "gqa")
    assert convert_main([path, str(tmp_path / "mf"), "--to", "mindformers"]) == 0
    assert sorted(n for n in os.listdir(tmp_path / "mf") if not n.startswith(".")) == \
        ["llama.ckpt", "llama_mindlab.yaml", "tokenizer.model"]
    mf = build_model(OmegaConf.merge(model_cfg, {"impl": "mindformers"}), 64, "fp32", "CPU", seed=1)
    ms.load_param_into_net(mf, ms.load_checkpoint(str(tmp_path / "mf" / "llama.ckpt")), strict_load=True)
    x = Tensor(tokens(64))  # MindFormers' Llama takes exactly its configured seq_length
    np.testing.assert_allclose(mf(x).asnumpy(), model(x).asnumpy(), atol=1e-5)
    mf_yaml = OmegaConf.load(tmp_path / "mf" / "llama_mindlab.yaml")
    assert mf_yaml.model.model_config.n_kv_heads == 2 and mf_yaml.model.arch.type == "LlamaForCausalLM"
    assert mf_yaml.load_checkpoint == str(tmp_path / "mf" / "llama.ckpt")  # the file in place, not the temporary one
