"""Evaluation of a language model: what `python -m evaluation` reports for a checkpoint and what training logs
at every evaluation (the trainer imports this package; it imports no trainer).

    validation.py  the objective's loss and metrics over validation batches, token-weighted (training's val_*)
    bpb.py         bits per byte: the UTF-8 bytes of target tokens; the unigram baseline
    position.py    loss by position in the row
    scorer.py      LoglikelihoodScorer: summed log-probabilities of continuations, batched
    tasks.py       the task file formats, their checks and scores (accuracy, exact match, ROUGE-L)
    passkey.py     passkey retrieval by log-likelihood
    sources.py     the per-source run over a checkpoint's validation data
    config.py      the checkpoint's config composed with the command line's overrides; the `eval.*` keys
    model.py       the checkpoint's model, its context window
    run.py         one checkpoint evaluated: sources, passkey, tasks
    report.py      the printed tables

What it asks of an objective are hooks, never its name (objectives/__init__.py lists them): `token_nll(model)`,
a causal LM's per-token NLL whose mean is the loss (bits per byte, loss by position, tasks, passkey), and
`fill_mask(model, k)`, a masked LM's top-k predictions. Generation goes through the family's generator
(models/generation.py).
"""
