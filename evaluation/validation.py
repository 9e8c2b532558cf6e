"""The objective's loss and metrics over held-out batches, each batch weighted by its loss tokens: what training
logs as val_loss, val_<metric> (and per source), and what `python -m evaluation` reports as `loss`, by the same
code, so its loss column reproduces a run's val_loss."""
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

Means = Tuple[Dict[str, float], int]  # ({"loss": ..., <metric>: ...}, loss tokens)


def lm_loss_only(net):
    """The objective's loss cell `net` reporting the objective's loss alone: over a model with an auxiliary loss
    (a mixture of experts' routers, models/common/causal_lm.py HAS_AUX) its `has_aux` is set false, so it runs the
    model's plain forward, adds no auxiliary loss and records no router statistics. What validation, `python -m
    evaluation` and bits per byte report, comparable between a dense and a MoE model (Megatron-Core's `lm loss`,
    its load-balancing and z-losses logged apart; the router's numbers are the training steps' `step_metrics`)."""
    if getattr(net, "has_aux", False):
        net.has_aux = False
    return net


def batch_means(loss_net, objective, batches: List[tuple]) -> Means:
    """(the objective's loss and metrics over `batches` through its loss cell `loss_net`, each batch weighted by its
    loss tokens; those tokens)."""
    from mindspore import Tensor

    outs = np.array([[float(x.asnumpy()) for x in loss_net(*map(Tensor, inputs))] for inputs in batches])
    weights = [max(objective.loss_tokens(inputs), 1) for inputs in batches]
    means = np.average(outs, axis=0, weights=weights)
    return dict(zip(("loss",) + tuple(objective.metrics), means.tolist())), sum(weights)


def val_metrics(per_source: Dict[str, Means], metrics: Sequence[str],
                val_bytes: Optional[Dict[str, int]] = None) -> dict:
    """val_loss (token-weighted over all sources), per source val_loss/<source>; the objective's `metrics` as
    val_<metric> and val_<metric>/<source>. With `val_bytes` (per source, the UTF-8 bytes of the loss targets,
    given when the loss is their mean NLL in nats: evaluation/bpb.py val_target_bytes): val_ppl, val_bpb and
    val_bpb/<source> (the exp of a masked LM's or a preference loss is no perplexity)."""
    out = {}
    if not per_source:
        return out
    tokens = [n for _, n in per_source.values()]
    for key in ("loss",) + tuple(metrics):
        out[f"val_{key}"] = float(np.average([m[key] for m, _ in per_source.values()], weights=tokens))
        out.update({f"val_{key}/{source}": m[key] for source, (m, _) in per_source.items()})
    if val_bytes:
        out["val_ppl"] = math.exp(min(out["val_loss"], 50.0))
        # the mean NLL x its tokens, of the sources whose targets hold text (an eos alone, e.g. of a response cut
        # off by truncation, is a token of no bytes: no bits per byte)
        nats = {source: m["loss"] * n for source, (m, n) in per_source.items() if val_bytes[source]}
        if nats:
            out["val_bpb"] = sum(nats.values()) / math.log(2) / sum(val_bytes[s] for s in nats)
            out.update({f"val_bpb/{s}": v / math.log(2) / val_bytes[s] for s, v in nats.items()})
    return out
