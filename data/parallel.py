"""An ordered map over chunks of work in worker processes, with a progress bar.

Workers are started with `spawn`, not `fork`: forking a process in which MindSpore's threads run can
deadlock. Spawned workers re-import the main script, so a script that prepares data needs the usual
`if __name__ == "__main__":` guard (train.py and prepare.py have it).
"""
from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, TypeVar

from tqdm import tqdm

from data.errors import DataError

T = TypeVar("T")
R = TypeVar("R")


class WorkerPool:
    """`num_workers` processes (0: everything runs in this process); use as a context manager."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._executor: Optional[ProcessPoolExecutor] = None

    def __enter__(self) -> "WorkerPool":
        if self.num_workers > 0:
            self._executor = ProcessPoolExecutor(self.num_workers, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)

    def map(self, fn: Callable[..., R], chunks: Sequence[tuple], desc: str, sizes: Sequence[int]) -> Iterator[R]:
        """fn(*chunk) for every chunk, in order; the bar advances by sizes[i] (characters) as chunk i is done."""
        results: Iterable[R] = (self._executor.map(fn, *zip(*chunks)) if self._executor and chunks
                                else (fn(*chunk) for chunk in chunks))
        with tqdm(total=sum(sizes), desc=desc, unit="char", unit_scale=True, leave=False) as bar:
            try:
                for size, result in zip(sizes, results):
                    bar.update(size)
                    yield result
            except BrokenProcessPool as e:
                raise DataError(f"a data worker process died ({e}); its error is printed above. Killed for memory: "
                                f"lower data.num_workers. Re-imported the main script: guard it with "
                                f"`if __name__ == \"__main__\":`") from e


def chunk_by_size(items: List[T], size_of: Callable[[T], int], target: int) -> List[List[T]]:
    """Consecutive runs of `items` whose sizes add up to about `target` (at least one item each)."""
    chunks, current, total = [], [], 0
    for item in items:
        current.append(item)
        total += size_of(item)
        if total >= target:
            chunks.append(current)
            current, total = [], 0
    return chunks + [current] if current else chunks
