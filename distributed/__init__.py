"""Running on several devices with MindSpore: msrun launch and its watchdog (launch.py), data parallelism
(data_parallel.py), tensor/pipeline parallelism applied to a model family's plan (semi_auto.py), and
checkpoints as per-rank slices (sharded_checkpoint.py, reshard.py). Planning without devices: planner/."""
