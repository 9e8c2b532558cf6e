"""Blocks several decoder families share, each family's model assembling them (no family's internals imported by
another):

    layers.py      Linear, RMSNorm, the SwiGLU FeedForward, the token Embedding
    attention.py   causal self-attention: RoPE, GQA, the plain and flash cores, the cached inference path
    rope.py        RoPE tables and their long-context scalings
    causal_lm.py   CausalLM, the interface objectives and evaluation use (hidden states, head, auxiliary loss)
    generation.py  KV-cache generation of a CausalLM built of these blocks

Not a family: models/__init__.py registers every other folder.
"""
