"""Planning a run without running it, pure Python (no MindSpore): the rank layout (layout.py), the per-device
memory plan (memory.py), the step-time model (timing.py), the layout search (advisor.py), the launch commands
(launch.py) and the `dry_run=true` report (dry_run.py). Answers for a 70B model on 64 devices from a laptop."""
