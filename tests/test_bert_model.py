"""The native MindSpore BERT against Hugging Face `BertForPreTraining`, its accounting, and its invariants."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn, ops

from models.bert.accounting import parameter_count
from models.bert.config import BertConfig
from models.bert.hf import config_from_hf, from_hf, hf_config, to_hf
from models.bert import recompute_cells
from models.bert.model import BertForPreTraining

pytestmark = pytest.mark.usefixtures("pynative")  # recompute needs graph mode: see below

VOCAB, SEQ = 1000, 16


def tiny(**overrides):
    fields = dict(name="bert_tiny", vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                  intermediate_size=128, max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
    fields.update(overrides)
    return BertConfig(**fields)


def batch(seed=0):
    """Two sequences: row 0 all real tokens, row 1 padded (pad id 0, attention_mask 0) from position 10.
    Segment A is the first 6 tokens, segment B the rest."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, VOCAB, (2, SEQ)).astype(np.int32)
    token_types = np.zeros((2, SEQ), np.int32)
    token_types[:, 6:] = 1
    mask = np.ones((2, SEQ), np.int32)
    mask[1, 10:] = 0
    ids[1, 10:] = 0
    token_types[1, 10:] = 0
    return ids, token_types, mask


def run(model, ids, token_types, mask):
    mlm, nsp = model(Tensor(ids), Tensor(token_types), Tensor(mask))
    return mlm.asnumpy(), nsp.asnumpy()


def perturbed(model, seed):
    """Random values for every parameter (biases and LayerNorms too), so that a misplaced bias, a swapped
    LayerNorm weight/bias or an untied decoder bias cannot hide behind zero/one initial values."""
    rng = np.random.default_rng(seed)
    for p in model.get_parameters():
        base = 1.0 if p.name.endswith("LayerNorm.weight") else 0.0
        p.set_data(Tensor((base + rng.normal(0.0, 0.05, p.shape)).astype(np.float32)))
    return model


def hf_model(cfg):
    import torch
    from transformers import BertConfig as HFBertConfig, BertForPreTraining as HFBertForPreTraining

    torch.manual_seed(0)
    return HFBertForPreTraining(HFBertConfig(**hf_config(cfg))).eval()


def hf_run(model, ids, token_types, mask):
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids).long(), token_type_ids=torch.from_numpy(token_types).long(),
                    attention_mask=torch.from_numpy(mask).long())
    return out.prediction_logits.numpy(), out.seq_relationship_logits.numpy()


def test_parameter_names_are_hugging_face_state_dict_names():
    cfg = tiny()
    names = [p.name for p in BertForPreTraining(cfg).get_parameters()]
    hf_names = set(to_hf({}.fromkeys(names, None)))
    assert hf_names == set(hf_model(cfg).state_dict())
    assert len(names) == len(set(names))


def test_export_to_hugging_face_gives_the_same_logits():
    import torch

    cfg = tiny()
    ours = perturbed(BertForPreTraining(cfg, seed=0), seed=1)
    hf = hf_model(cfg)
    sd = to_hf({p.name: p.asnumpy() for p in ours.get_parameters()})
    result = hf.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight  # still tied
    x = batch()
    mlm, nsp = run(ours, *x)
    hf_mlm, hf_nsp = hf_run(hf, *x)
    print(f"export parity: max |d mlm| {np.abs(mlm - hf_mlm).max():.3g}, max |d nsp| {np.abs(nsp - hf_nsp).max():.3g}")
    np.testing.assert_allclose(mlm, hf_mlm, atol=1e-4)  # all positions, padded ones included
    np.testing.assert_allclose(nsp, hf_nsp, atol=1e-4)


def test_import_from_hugging_face_gives_the_same_logits():
    import torch

    cfg = tiny()
    hf = hf_model(cfg)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(2)
        for name, p in hf.named_parameters():  # each tied tensor once
            base = 1.0 if name.endswith("LayerNorm.weight") else 0.0
            p.copy_(base + 0.05 * torch.randn(p.shape, generator=gen))
    sd = from_hf({k: v.numpy() for k, v in hf.state_dict().items()}, {})
    ours = BertForPreTraining(cfg, seed=3)
    params = {p.name: p for p in ours.get_parameters()}
    assert sorted(sd) == sorted(params)
    for name, value in sd.items():
        params[name].set_data(Tensor(value.copy()))
    x = batch()
    mlm, nsp = run(ours, *x)
    hf_mlm, hf_nsp = hf_run(hf, *x)
    print(f"import parity: max |d mlm| {np.abs(mlm - hf_mlm).max():.3g}, max |d nsp| {np.abs(nsp - hf_nsp).max():.3g}")
    np.testing.assert_allclose(mlm, hf_mlm, atol=1e-4)
    np.testing.assert_allclose(nsp, hf_nsp, atol=1e-4)


def test_untied_hugging_face_decoder_is_refused():
    sd = {"bert.embeddings.word_embeddings.weight": np.zeros((4, 2)), "cls.predictions.bias": np.zeros(4),
          "cls.predictions.decoder.weight": np.ones((4, 2)), "cls.predictions.decoder.bias": np.zeros(4),
          "bert.embeddings.position_ids": np.arange(4)[None]}
    with pytest.raises(ValueError, match="ties the MLM decoder"):
        from_hf(sd, {})
    del sd["cls.predictions.decoder.weight"]
    assert sorted(from_hf(sd, {})) == ["bert.embeddings.word_embeddings.weight", "cls.predictions.bias"]


def test_config_round_trip_through_hugging_face():
    from transformers import BertConfig as HFBertConfig

    cfg = tiny(hidden_dropout=0.1, attention_dropout=0.2, init_std=0.03)
    back = config_from_hf(HFBertConfig(**hf_config(cfg)).to_dict(), "config.json")
    assert BertConfig(name=cfg.name, **back) == cfg


def test_parameter_count_matches_built_model_and_hugging_face():
    import torch
    from transformers import BertConfig as HFBertConfig, BertForPreTraining as HFBertForPreTraining

    cfg = tiny()
    ours = BertForPreTraining(cfg)
    assert sum(p.size for p in ours.trainable_params()) == parameter_count(cfg)["total"]
    assert sum(p.numel() for p in hf_model(cfg).parameters()) == parameter_count(cfg)["total"]

    base = tiny(vocab_size=30522, hidden_size=768, num_layers=12, num_heads=12, intermediate_size=3072,
                max_position_embeddings=512)
    with torch.device("meta"):  # shapes only: no memory, no init time
        hf = HFBertForPreTraining(HFBertConfig(**hf_config(base)))
    assert hf.cls.predictions.decoder.weight is hf.bert.embeddings.word_embeddings.weight
    assert sum(p.numel() for p in hf.parameters()) == parameter_count(base)["total"] == 110_106_428


def test_attention_is_bidirectional_and_ignores_padding():
    model = perturbed(BertForPreTraining(tiny()), seed=4)
    ids, token_types, mask = batch()
    mlm, nsp = run(model, ids, token_types, mask)

    changed = ids.copy()
    changed[0, 12] = (changed[0, 12] + 1) % VOCAB  # a real token late in row 0
    mlm2, _ = run(model, changed, token_types, mask)
    assert np.abs(mlm2[0, :12] - mlm[0, :12]).max() > 1e-4  # earlier positions see it
    np.testing.assert_array_equal(mlm2[1], mlm[1])  # rows are independent

    changed = ids.copy()
    changed[1, 10:] = np.arange(11, 17)  # other tokens where row 1 is padding
    changed_types = token_types.copy()
    changed_types[1, 10:] = 1
    mlm3, nsp3 = run(model, changed, changed_types, mask)
    np.testing.assert_allclose(mlm3[1, :10], mlm[1, :10], atol=1e-6)
    np.testing.assert_allclose(nsp3, nsp, atol=1e-6)


def test_dropout_only_in_training_mode():
    x = batch()
    plain = BertForPreTraining(tiny())
    dropped = BertForPreTraining(tiny(hidden_dropout=0.1, attention_dropout=0.1))
    ref, _ = run(plain, *x)
    dropped.set_train(False)
    np.testing.assert_allclose(run(dropped, *x)[0], ref, atol=1e-6)
    dropped.set_train(True)
    assert np.abs(run(dropped, *x)[0] - ref).max() > 1e-3
    assert not any(isinstance(c, nn.Dropout) for _, c in plain.cells_and_names())  # rate 0: no dropout op


def test_fp16_compute_stays_close_to_fp32():
    x = batch()
    mlm, nsp = run(perturbed(BertForPreTraining(tiny()), seed=5), *x)
    mlm16, nsp16 = run(perturbed(BertForPreTraining(tiny(), compute_dtype="fp16"), seed=5), *x)
    assert mlm16.dtype == nsp16.dtype == np.float32
    np.testing.assert_allclose(mlm16, mlm, atol=2e-2)
    np.testing.assert_allclose(nsp16, nsp, atol=2e-2)


class PreTrainingLoss(nn.Cell):
    """Mean MLM cross-entropy over all positions + NSP cross-entropy: just something to differentiate."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, token_types, mask, mlm_labels, nsp_labels):
        mlm, nsp = self.model(ids, token_types, mask)
        return (ops.cross_entropy(mlm.reshape(-1, mlm.shape[-1]), mlm_labels.reshape(-1))
                + ops.cross_entropy(nsp, nsp_labels))


def _loss_and_grads(mode):
    model = perturbed(BertForPreTraining(tiny()), seed=6)
    for cell in recompute_cells(model, mode) if mode != "none" else []:
        cell.recompute()
    loss_net = PreTrainingLoss(model)
    params = ms.ParameterTuple(model.trainable_params())
    ids, token_types, mask = batch()
    inputs = [Tensor(a) for a in (ids, token_types, mask, np.roll(ids, 1, 1), np.array([0, 1], np.int32))]
    loss, grads = ms.value_and_grad(loss_net, None, params)(*inputs)
    return float(loss.asnumpy()), [g.asnumpy() for g in grads]


@pytest.mark.slow  # three gradient graphs compiled, ~12 s
def test_recompute_gives_the_same_loss_and_gradients():
    ms.set_context(mode=ms.GRAPH_MODE)  # recompute is a pass of the graph compiler
    ref_loss, ref_grads = _loss_and_grads("none")
    for mode in ("full", "selective"):
        loss, grads = _loss_and_grads(mode)
        assert loss == pytest.approx(ref_loss, abs=1e-6)
        for a, b in zip(grads, ref_grads):
            np.testing.assert_allclose(a, b, atol=1e-6)
