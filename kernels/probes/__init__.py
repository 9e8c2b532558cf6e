"""Probes for whoever changes a kernel, not benchmarks for users:

    python -m kernels.probes.ops [--only adamw,rope_forward] [--compare attention=/tmp/attention.so]
        each compiled kernel on its own through ctypes at model=small's shapes (and A/B against another build)
    python -m kernels.probes.mindspore_ops
        MindSpore's own CPU ops on the same data in different layouts: why the model reduces 2-D views and
        broadcasts columns with Tile on CPU
"""
