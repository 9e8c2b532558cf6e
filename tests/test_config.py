"""Every cross-field rule refuses a bad value with a message naming the key; presets compose and validate."""
import pytest

from base.validate import ConfigError, validate
from conftest import compose_cfg, train_main


BAD = [
    (["model.num_heads=3"], "model.num_heads", "not divisible"),
    (["model.num_kv_heads=3"], "model.num_kv_heads", "not a multiple"),
    (["model=13b", "parallel=tp8pp2", "model.num_heads=36", "model.num_kv_heads=36", "model.hidden_size=5184",
      "dry_run=true"], "parallel.tp", "num_heads"),
    (["model=70b", "parallel=tp8pp4", "model.num_kv_heads=4", "model.num_heads=64", "dry_run=true"],
     "parallel.tp", "num_kv_heads"),
    (["model=13b", "parallel=tp8pp4", "model.num_layers=42", "dry_run=true"], "parallel.pp", "num_layers"),
    (["model=7b", "parallel=tp8pp2", "model.vocab_size=32001", "data.tokenizer.vocab_size=32001", "dry_run=true"],
     "parallel.tp", "vocab_size"),
    (["trainer.global_batch_size=100"], "trainer.global_batch_size", "micro_batch_size"),
    (["data.seq_len=4096"], "data.seq_len", "max_position_embeddings"),
    (["parallel=tp8pp2", "model=13b"], "parallel", "16 Ascend/GPU devices, found CPU"),
    (["parallel=dp2"], "parallel", "2 processes but 1 were launched"),
    (["+model.hiden_size=3"], "model.hiden_size", "did you mean model.hidden_size"),
    (["+trainer.max_step=3"], "trainer.max_step", "did you mean trainer.max_steps"),
    (["optim.lr=0"], "optim.lr", "(0, 1]"),
    (["optim.lr=2.0"], "optim.lr", "(0, 1]"),
    (["optim.warmup_steps=5000"], "optim.warmup_steps", "max_steps"),
    (["optim.min_lr=1.0"], "optim.min_lr", "optim.lr"),
    (["optim=came", "optim.clip_threshold=0"], "optim.clip_threshold", "> 0"),
    (["optim.warmup_fraction=1.0"], "optim.warmup_fraction", "[0, 1)"),
    (["precision=bf16"], "precision", "bf16"),
    (["model.flash_attention=true"], "model.flash_attention", "has no CPU kernel"),
    (["model.recompute=some"], "model.recompute", "none, full, selective"),
    (["model.attention_kernel=flash"], "model.attention_kernel", "auto, fused, plain"),
    (["model.attention_kernel=fused", "model.attention_chunk=64"], "model.attention_chunk", "blocks of query rows"),
    (["model.attention_kernel=fused", "model.impl=mindformers"], "model.impl", "native model's"),
    (["model.attention_kernel=fused", "precision=fp16"], "precision.compute_dtype", "computes in fp32"),
    (["model.layer_kernels=yes"], "model.layer_kernels", "auto, fused, plain"),
    (["model.layer_kernels=fused", "precision=bf16"], "precision.compute_dtype", "computes in fp32"),
    (["data.tokenizer.vocab_size=1000"], "data.tokenizer.vocab_size", "model.vocab_size"),
    (["parallel=tp8pp2", "model=13b", "parallel.micro_batches=1", "dry_run=true"],
     "parallel.micro_batches", "fill"),
    (["parallel=tp8pp2", "model=13b", "trainer.global_batch_size=8", "dry_run=true"],
     "trainer.global_batch_size", "parallel.micro_batches (8)"),
    (["parallel=tp8pp2", "model=13b", "trainer.grad_accum=2", "dry_run=true"], "trainer.grad_accum",
     "accumulate with parallel.micro_batches"),
    (["parallel=tp8dp4", "model=13b", "trainer.spike_factor=3", "dry_run=true"], "trainer.spike_factor",
     "one-graph sharded step"),
    (["parallel=tp8pp2", "model=13b", "model.impl=mindformers", "dry_run=true"], "model.impl", "native"),
    (["parallel=dp2", "parallel.optimizer_shard=true"], "parallel.optimizer_shard", "semi-auto parallel mode"),
]


@pytest.mark.parametrize("overrides,key,words", BAD, ids=[b[1] + ":" + b[0][-1] for b in BAD])
def test_bad_value_is_refused_naming_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides))
    assert err.value.key == key
    assert words in str(err.value)


@pytest.mark.parametrize("max_steps, warmup", [(60, 6), (1000, 100), (5, 0)])
def test_unset_warmup_is_a_tenth_of_any_run_length(max_steps, warmup):
    """`python train.py trainer.max_steps=60` was refused while the default warmup was a fixed 100 steps."""
    from trainer.optimizer import warmup_steps

    for optim in ("adamw", "adamw_bert", "came"):
        cfg = compose_cfg(f"optim={optim}", f"trainer.max_steps={max_steps}")
        validate(cfg)
        assert cfg.optim.warmup_steps is None and warmup_steps(cfg.optim, max_steps) == warmup


def test_optimizer_keys_belong_to_their_preset():
    """Each preset is its own typed config: AdamW's betas are not a CAME key."""
    with pytest.raises(Exception, match="betas"):
        compose_cfg("optim=came", "optim.betas=[0.9,0.99]")
    assert compose_cfg("optim=came").optim.decay_rate == 0.8


# The pairs the validator refuses, worked out by hand from the presets' shapes (heads, kv heads, layers; every
# vocabulary and ffn width divides by 8): tiny 4/2/4, small 6/6/8, 125m 12/12/12, 1b 32/4/22; 350m 16/16/24,
# 7b 32/32/32, 13b 40/40/40, 70b 64/8/80 fit every layout. The message names the first rule broken (pp before tp).
REFUSED = {
    ("tiny", "tp8pp2"): "parallel.tp: tp=8 does not divide model.num_heads=4",
    ("tiny", "tp8pp4"): "parallel.tp: tp=8 does not divide model.num_heads=4",
    ("tiny", "tp8dp4"): "parallel.tp: tp=8 does not divide model.num_heads=4",
    ("tiny", "tp4pp2dp2"): "parallel.tp: tp=4 does not divide model.num_kv_heads=2",
    **{("small", p): f"parallel.tp: tp={p[2]} does not divide model.num_heads=6"
       for p in ("tp8pp2", "tp8pp4", "tp4pp2dp2", "tp8dp4")},
    **{("125m", p): "parallel.tp: tp=8 does not divide model.num_heads=12" for p in ("tp8pp2", "tp8pp4", "tp8dp4")},
    ("1b", "tp8pp2"): "parallel.tp: tp=8 does not divide model.num_kv_heads=4",
    ("1b", "tp8dp4"): "parallel.tp: tp=8 does not divide model.num_kv_heads=4",
    ("1b", "tp8pp4"): "parallel.pp: pp=4 does not divide model.num_layers=22",
}


@pytest.mark.parametrize("model", ["tiny", "small", "125m", "350m", "1b", "7b", "13b", "70b"])
@pytest.mark.parametrize("parallel", ["single", "dp2", "dp8", "tp8pp2", "tp8pp4", "tp4pp2dp2", "tp8dp4"])
def test_layout_presets_against_model_presets(model, parallel):
    """Legal pairs pass (in dry-run on the device they are for, where no devices are needed); illegal ones name the
    rule they break."""
    cfg = compose_cfg(f"model={model}", f"parallel={parallel}", "device=ascend910b", "dry_run=true",
                      "trainer.micro_batch_size=16")
    if (model, parallel) in REFUSED:
        with pytest.raises(ConfigError) as refused:
            validate(cfg)
        assert str(refused.value) == REFUSED[model, parallel]
    else:
        validate(cfg)


def test_cli_refuses_tensor_parallel_on_cpu_with_one_clear_message(tmp_path, monkeypatch):
    code, _, err = train_main(tmp_path, monkeypatch, "model=13b", "parallel=tp8pp2", "stage=pretrain")
    assert code == 2
    assert "config error: parallel: parallel=tp8pp2 (dp=1 x tp=8 x pp=2) needs 16 Ascend/GPU devices, found CPU" \
        in err


@pytest.mark.parametrize("model,parallel,params", [("13b", "tp8pp2", 13_015_864_320),
                                                   ("70b", "tp8pp4", 68_976_648_192)])
def test_dry_run_prints_the_plan(tmp_path, monkeypatch, model, parallel, params):
    code, out, err = train_main(tmp_path, monkeypatch, f"model={model}", f"parallel={parallel}",
                               "device=ascend910b", "stage=pretrain", "dry_run=true")
    assert code == 0, err
    assert f"({params:,})" in out
    for section in ("layout", "memory per device", "FLOPs per token", "tp groups"):
        assert section in out


def test_cfg_job_prints_the_composed_config(tmp_path, monkeypatch):
    code, out, _ = train_main(tmp_path, monkeypatch, "--cfg", "job", "model=7b")
    assert code == 0
    assert "hidden_size: 4096" in out and "parallel:" in out


def test_help_lists_the_groups_presets_and_not_the_schemas_nodes():
    from conftest import invoke

    out = invoke("train", ["--help"])
    assert out.code == 0 and "base_" not in out.out and "recipe" in out.out
    assert "  objective  clm, dpo, mlm, ppo, rm, sft\n" in out.out and "  stage      " in out.out
