"""The CPU's fp32 peak, the MFU denominator of device=cpu, from the machine it runs on: a fixed datasheet figure
is right for one CPU only (written for a Zen 4 EPYC, it sat below what an AVX-512 Xeon computes, and MFU read
over 100%).

    peak = max(cores x clock x FLOPs per cycle, the best fp32 GEMM measured on this CPU)

The first term from /proc/cpuinfo: the CPUs this process may run on, the clock the kernel reports (the highest
of cpufreq's maximum and "cpu MHz"), and FLOPs per cycle per core from the vector flags: 2 (fused multiply-add)
x fp32 lanes x 2 FMA pipes, 16 lanes with AVX-512 on Intel and on AMD from Zen 5 ("cpu family" 26), 8 with AVX2
and FMA, or with AVX-512 on AMD before Zen 5 (which runs 512-bit vectors on its 256-bit pipes). A virtual machine often shows the base clock, not the
boost one, so the product can sit below what the CPU does; hence the second term, a square fp32 matmul (the
faster of NumPy's BLAS and oneDNN's sgemm, one sgemm a CPU at once, best of 5) measured once per CPU (model, flags, CPU
count) and cached in ~/.cache/mindlab/cpu_peak.json (MINDLAB_CACHE_DIR moves it; delete the entry to measure again)
with the load average it was taken under: a measurement taken on a busy machine is low, so while the cached one's
load is above BUSY_LOAD a run on a machine at most half as busy measures again and keeps the higher figure.
SpeedMonitor (trainer/metrics.py) says so in one line if a step still computes above the peak.
"""
import functools
import json
import os
import time
from pathlib import Path
from typing import Callable, Dict, Optional

ZEN5_FAMILY = 26  # AMD's "cpu family" of Zen 5, the first to run AVX-512 on 512-bit pipes
GEMM_N = 2048  # 17 GFLOP a product, tens of ms: thread start-up is lost in it; the measurement takes about a second
# the 1-minute load average per CPU at or below which a measurement is taken as the CPU's own (not measured again)
BUSY_LOAD = 0.25
LOADS = "load per CPU of each measurement"  # the cache's entry of the loads, by CPU key


def cpu_info(text: Optional[str] = None) -> Dict[str, str]:
    """The first processor's fields of /proc/cpuinfo (or of `text`), plus the highest "cpu MHz" of all."""
    if text is None:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    fields: Dict[str, str] = {}
    mhz = []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "cpu MHz":
            mhz.append(float(value))
        fields.setdefault(key, value)
    if mhz:
        fields["cpu MHz"] = str(max(mhz))
    return fields


def flops_per_cycle(info: Dict[str, str]) -> int:
    """fp32 FLOPs one core issues per cycle at most: 2 (FMA) x lanes x 2 pipes (see the module's docstring)."""
    flags = set(info.get("flags", "").split())
    zen5 = info.get("vendor_id") == "AuthenticAMD" and int(info.get("cpu family", 0) or 0) >= ZEN5_FAMILY
    if "avx512f" in flags and (info.get("vendor_id") == "GenuineIntel" or zen5):
        lanes = 16
    elif "avx512f" in flags or {"avx2", "fma"} <= flags:
        lanes = 8
    elif "avx" in flags:
        lanes = 8 // 2  # AVX without FMA: a multiply and an add pipe, 8 lanes each, counted as 4 FMA lanes
    else:
        lanes = 4 // 2
    return 2 * lanes * 2


def clock_hz(info: Dict[str, str], max_freq_file: str = "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq"):
    reported = float(info.get("cpu MHz", 0)) * 1e6
    try:
        with open(max_freq_file, encoding="utf-8") as f:
            return max(reported, float(f.read()) * 1e3)  # kHz
    except (OSError, ValueError):
        return reported


def estimated_tflops(info: Dict[str, str], cpus: int, clock: float) -> float:
    return cpus * clock * flops_per_cycle(info) / 1e12


def best_seconds(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` calls of fn, after one to warm up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sgemm_function() -> Optional[Callable]:
    """oneDNN's `dnnl_sgemm` (row-major C = alpha op(A) op(B) + beta C) from the libdnnl.so.3 MindSpore ships (the
    library its CPU matmuls run on), or None where MindSpore ships none. A call runs on the calling thread only."""
    import ctypes
    import importlib.util

    spec = importlib.util.find_spec("mindspore")
    library = os.path.join(os.path.dirname(spec.origin), "lib", "libdnnl.so.3") if spec and spec.origin else ""
    if not os.path.exists(library):
        return None
    sgemm = ctypes.CDLL(library).dnnl_sgemm
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    sgemm.argtypes = [ctypes.c_char, ctypes.c_char, i64, i64, i64, f32, ptr, i64, ptr, i64, f32, ptr, i64]
    return sgemm


def rows_sgemm(sgemm: Callable, a, b, c, threads: int) -> None:
    """c = a @ b (square, row-major fp32) with `threads` threads, each one sgemm over its block of a's rows: ctypes
    lets go of the GIL during the call, so the blocks run at once, one a CPU."""
    import threading

    n = a.shape[0]

    def block(t: int) -> None:
        lo, hi = n * t // threads, n * (t + 1) // threads
        sgemm(b"N", b"N", hi - lo, n, n, 1.0, a.ctypes.data + lo * n * 4, n, b.ctypes.data, n, 0.0,
              c.ctypes.data + lo * n * 4, n)

    others = [threading.Thread(target=block, args=(t,)) for t in range(1, threads)]
    for thread in others:
        thread.start()
    block(0)
    for thread in others:
        thread.join()


def measure_gemm_tflops(n: int = GEMM_N, repeats: int = 5, threads: Optional[int] = None) -> float:
    """The faster of NumPy's BLAS and oneDNN's sgemm on an n x n fp32 product, on every CPU this process may run on
    (`threads`): the peak is the machine's, and a single sgemm call uses one CPU."""
    import numpy as np

    threads = threads or len(os.sched_getaffinity(0))
    rng = np.random.default_rng(0)
    a, b, c = rng.random((n, n), np.float32), rng.random((n, n), np.float32), np.zeros((n, n), np.float32)
    seconds = [best_seconds(lambda: a @ b, repeats)]
    sgemm = sgemm_function()
    if sgemm is not None:
        seconds.append(best_seconds(lambda: rows_sgemm(sgemm, a, b, c, threads), repeats))
    return 2 * n ** 3 / min(seconds) / 1e12


def cache_file() -> Path:
    root = os.environ.get("MINDLAB_CACHE_DIR") or Path.home() / ".cache" / "mindlab"
    return Path(root) / "cpu_peak.json"


def cpu_key(info: Dict[str, str], cpus: int) -> str:
    """The cache's key: the CPU, how many of them the GEMM ran on, and how (a figure taken another way is not
    this one's)."""
    return (f"{info.get('vendor_id', '?')} | {info.get('model name', '?')} | {cpus} CPUs, sgemm on each | "
            f"{info.get('flags', '')}")


def load_per_cpu() -> float:
    """The machine's 1-minute load average per CPU: other processes' share of the CPUs a measurement would run on."""
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def measured_tflops(key: str, measure: Callable[[], float] = measure_gemm_tflops, path: Optional[Path] = None,
                    load: Callable[[], float] = load_per_cpu) -> float:
    """This CPU's cached GEMM figure, measured (and the cache written) when there is none, or when the cached one
    was taken under a load above BUSY_LOAD and the machine is at most half as busy now: then the higher figure is
    kept, with the lower load (so a figure that stays the highest is not measured again at the same load). The
    loads sit apart from the figures (under LOADS), which older readers of the cache take as they are; a figure
    without its load counts as taken under load."""
    path = path or cache_file()
    try:
        cached = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cached = {}
    loads = cached.setdefault(LOADS, {})
    now, taken = load(), loads.get(key)
    if key in cached and taken is not None and (taken <= BUSY_LOAD or now > taken / 2):
        return cached[key]
    cached[key] = max(measure(), cached.get(key, 0.0))
    loads[key] = round(now if taken is None else min(now, taken), 3)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cached, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return cached[key]


@functools.lru_cache(maxsize=None)
def cpu_peak_tflops() -> float:
    """`${cpu_peak:}` (conf/device/cpu.yaml): this machine's fp32 peak in TFLOP/s."""
    info, cpus = cpu_info(), len(os.sched_getaffinity(0))
    return max(estimated_tflops(info, cpus, clock_hz(info)), measured_tflops(cpu_key(info, cpus)))
