"""Sweep presets for `python train.py -m +sweep=<name>` and the multirun comparison report.

This package is on Hydra's search path (`pkg://sweeps` in conf/config.yaml): `sweep/*.yaml` are the
`+sweep=` presets, `hydra/launcher/slurm.yaml` is the Slurm launcher preset. `python -m sweeps.report DIR`
compares the runs of a multirun dir. See sweeps/README.md.
"""
