"""Where mindlab finds things on disk by default: this checkout, the data cache, the shared corpora, task files."""
import os
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent


def data_dir() -> Path:
    """${MINDLAB_DATA_DIR:-~/.cache/mindlab/data}: prepared data, built instruction/preference sets and tasks."""
    return Path(os.environ.get("MINDLAB_DATA_DIR") or Path.home() / ".cache" / "mindlab" / "data")


def corpora_dir() -> Path:
    """$MINDLAB_CORPORA, else ../shared/corpora beside this checkout (as conf/data/corpora_tiny.yaml)."""
    return Path(os.environ.get("MINDLAB_CORPORA") or REPO_ROOT.parent / "shared" / "corpora")


def default_tasks_dir() -> Path:
    """<data dir>/tasks, where `python -m builders.tasks build` writes the evaluation tasks."""
    return data_dir() / "tasks"


def task_path(name: str, tasks_dir: Optional[os.PathLike] = None) -> Path:
    """A task name ('definitions_mc') -> <tasks_dir>/<name>.jsonl; a path ending in .jsonl is taken as it is."""
    if name.endswith(".jsonl"):
        return Path(name)
    return Path(tasks_dir or default_tasks_dir()) / f"{name}.jsonl"
