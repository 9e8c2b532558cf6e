"""Parity checks against independent implementations, run by the tests and by hand:

    python -m parity.step [optim=adamw_bert] [trainer.grad_accum=2] [steps=120]    # the training step vs PyTorch
    python -m parity.step bert [steps=120]                                         # BERT MLM + NSP

step.py: mindlab's whole training step (loader, objective, accumulation, clipping, optimizer, schedule) against
transformers' model + torch.optim.AdamW from the same weights on the same batches.
"""
