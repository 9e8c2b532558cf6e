"""Worker processes for prepare's steps: tasks run in `data.num_workers` processes that die with this one,
and a progress bar (bytes/s, ETA) that the tasks advance as they go.

Workers are started with `spawn`, not `fork`: forking a process in which MindSpore's threads run can
deadlock. Spawned workers re-import the main script, so a script that prepares data needs the usual
`if __name__ == "__main__":` guard (train.py and prepare.py have it).

A worker asks the kernel for SIGKILL when its parent dies (Linux prctl PR_SET_PDEATHSIG; elsewhere a thread
watches the parent's pid): a prepare killed with SIGKILL leaves no workers behind, and once they are gone
multiprocessing's resource tracker sees its pipe close and exits too.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, Optional, TypeVar

from tqdm import tqdm

from data.errors import DataError

R = TypeVar("R")
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_progress = None  # in a worker: the shared counter that report() advances; in this process: the open bar


def report(n: int) -> None:
    """Advance the running step's progress bar by `n` (bytes); call it from a task as its work gets done."""
    if _progress is None:
        return
    if isinstance(_progress, tqdm):
        _progress.update(n)
    else:
        with _progress.get_lock():
            _progress.value += n


class WorkerPool:
    """`num_workers` processes (0: every task runs in this process); use as a context manager."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._executor: Optional[ProcessPoolExecutor] = None
        self._counter = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        if self._executor is not None:
            self._executor.shutdown(cancel_futures=True)  # running tasks finish: what they wrote is kept

    def run(self, fn: Callable[..., R], tasks: Iterable[tuple], desc: str, total: int, unit: str = "B") -> Iterator[R]:
        """fn(*task) for every task, results in the order they finish (tasks are small: work units' names,
        not their data). The bar counts `total` (bytes, or `unit`s), advanced by report() inside fn."""
        global _progress
        if self.num_workers > 0 and self._executor is None:  # started on first use: a cached prepare starts none
            context = multiprocessing.get_context("spawn")
            self._counter = context.Value("q", 0)
            self._executor = ProcessPoolExecutor(self.num_workers, mp_context=context, initializer=_start_worker,
                                                 initargs=(os.getpid(), self._counter))
        with tqdm(total=total, desc=desc, unit=unit, unit_scale=True, leave=False) as bar:
            if self._executor is None:
                _progress = bar
                try:
                    for task in tasks:
                        yield fn(*task)
                finally:
                    _progress = None
                return
            with self._counter.get_lock():
                self._counter.value = 0
            pending = {self._executor.submit(fn, *task) for task in tasks}
            try:
                while pending:
                    done, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                    bar.update(self._counter.value - bar.n)
                    for future in done:
                        yield future.result()
            except BrokenProcessPool as e:
                raise DataError(f"a data worker process died ({e}); its error is printed above. Killed for memory: "
                                f"lower data.num_workers. Re-imported the main script: guard it with "
                                f"`if __name__ == \"__main__\":`") from e
            finally:
                for future in pending:
                    future.cancel()


def _start_worker(parent: int, counter) -> None:
    """Worker initializer: die with the parent, and count progress into the parent's counter."""
    global _progress
    _progress = counter
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
