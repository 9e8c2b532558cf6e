"""An ordered map over chunks of work in worker processes, with a progress bar.

Workers are started with `spawn`: forking a process that has MindSpore's threads running can deadlock.
"""
from __future__ import annotations

import multiprocessing
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, TypeVar

from tqdm import tqdm

T = TypeVar("T")
R = TypeVar("R")


class WorkerPool:
    """`num_workers` processes (0: everything runs in this process); use as a context manager."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._pool: Optional[multiprocessing.pool.Pool] = None

    def __enter__(self) -> "WorkerPool":
        if self.num_workers > 0:
            self._pool = multiprocessing.get_context("spawn").Pool(self.num_workers)
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()

    def map(self, fn: Callable[..., R], chunks: Sequence[tuple], desc: str, sizes: Sequence[int],
            unit: str = "char") -> Iterator[R]:
        """fn(*chunk) for every chunk, in order; the bar advances by sizes[i] as chunk i finishes."""
        results: Iterable[R] = (self._pool.imap(_Star(fn), chunks) if self._pool is not None
                                else (fn(*chunk) for chunk in chunks))
        with tqdm(total=sum(sizes), desc=desc, unit=unit, unit_scale=True, leave=False) as bar:
            for size, result in zip(sizes, results):
                bar.update(size)
                yield result


class _Star:
    """A picklable fn(*args)."""

    def __init__(self, fn: Callable[..., R]):
        self.fn = fn

    def __call__(self, args: tuple) -> R:
        return self.fn(*args)


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
