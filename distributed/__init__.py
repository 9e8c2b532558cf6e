"""Parallel layout and memory planning, pure Python (no MindSpore): used by the dry run."""
