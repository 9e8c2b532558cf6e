"""device=cpu's peak from the machine it runs on (base/cpu_peak.py), and an MFU above 100% said, not logged
silently (trainer/metrics.py SpeedMonitor)."""
import pytest

from base import cpu_peak
from conftest import compose_cfg, load_preset

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8272CL CPU @ 2.60GHz
cpu MHz\t\t: 2100.000
flags\t\t: fpu sse sse2 avx fma avx2 avx512f avx512dq avx512bw avx512vl

processor\t: 1
vendor_id\t: GenuineIntel
cpu MHz\t\t: 3000.000
"""
ZEN4 = ("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel name\t: AMD EPYC 9R14\ncpu MHz\t\t: 3700.000\n"
        "flags\t\t: sse avx fma avx2 avx512f\n")
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("9R14", "9R45")


def test_the_estimate_is_cores_times_clock_times_flops_per_cycle_by_hand():
    """Xeon (AVX-512, two 512-bit FMA pipes): 2 FLOPs x 16 lanes x 2 = 64 a cycle; the highest clock the kernel
    reports. Zen 4: AVX-512 on 256-bit pipes, 32 a cycle: 2 cores x 3.7 GHz x 32 = 0.2368 TFLOP/s, the datasheet
    figure conf/device/cpu.yaml held; Zen 5 ("cpu family" 26) runs them on 512-bit pipes, 64 a cycle. AVX2 + FMA:
    32; SSE only: 8."""
    xeon, zen4 = cpu_peak.cpu_info(XEON), cpu_peak.cpu_info(ZEN4)
    assert cpu_peak.flops_per_cycle(xeon) == 64 and cpu_peak.flops_per_cycle(zen4) == 32
    assert cpu_peak.flops_per_cycle(cpu_peak.cpu_info(ZEN5)) == 64  # Zen 5: AVX-512 on 512-bit pipes
    assert cpu_peak.clock_hz(xeon, "/no/such/file") == 3.0e9
    assert cpu_peak.estimated_tflops(xeon, 2, 3.0e9) == pytest.approx(2 * 3.0e9 * 64 / 1e12)
    assert cpu_peak.estimated_tflops(zen4, 2, cpu_peak.clock_hz(zen4, "/no/such/file")) == pytest.approx(0.2368)
    assert cpu_peak.flops_per_cycle({"flags": "sse avx2 fma"}) == 32
    assert cpu_peak.flops_per_cycle({"flags": "sse sse2"}) == 8


def test_the_gemm_runs_one_sgemm_a_cpu_and_computes_the_product():
    """A single sgemm call runs on one CPU, so the measurement splits a's rows over every CPU at once: the blocks
    put together equal NumPy's product, for a thread count that does not divide n."""
    import numpy as np

    sgemm = cpu_peak.sgemm_function()
    assert sgemm is not None  # MindSpore ships libdnnl.so.3 on x86 Linux
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((67, 67), np.float32), rng.standard_normal((67, 67), np.float32)
    for threads in (1, 3):
        c = np.full((67, 67), np.nan, np.float32)
        cpu_peak.rows_sgemm(sgemm, a, b, c, threads)
        np.testing.assert_allclose(c, a @ b, rtol=1e-5, atol=1e-4)


def test_the_measurement_is_taken_once_per_cpu_and_cached(tmp_path):
    """The Xeon whose base clock (2.1 GHz x 2 cores x 64 = 0.27) is below the 0.40 a GEMM reaches: the cached
    measurement is its peak, measured once for that CPU; another CPU is measured on its own."""
    calls = []

    def fake(value):
        return lambda: calls.append(value) or value

    path = tmp_path / "cpu_peak.json"
    key = cpu_peak.cpu_key(cpu_peak.cpu_info(XEON), 2)
    quiet = lambda: 0.1  # noqa: E731  (a load average per CPU below BUSY_LOAD)
    assert cpu_peak.measured_tflops(key, fake(0.40), path, quiet) == 0.40
    assert cpu_peak.measured_tflops(key, fake(0.10), path, quiet) == 0.40  # cached: a busy moment does not lower it
    assert cpu_peak.measured_tflops(key, fake(0.10), path, lambda: 0.0) == 0.40  # taken quiet: never measured again
    assert cpu_peak.measured_tflops(cpu_peak.cpu_key(cpu_peak.cpu_info(ZEN4), 2), fake(0.20), path, quiet) == 0.20
    assert calls == [0.40, 0.20]
    xeon = cpu_peak.cpu_info(XEON)
    assert max(cpu_peak.estimated_tflops(xeon, 2, 2.1e9), 0.40) == 0.40


def test_a_measurement_taken_under_load_is_taken_again_when_the_machine_is_quieter(tmp_path):
    """The first measurement ran at a load of 2 a CPU (0.15 TFLOP/s where the CPU does 0.40): at a load of 1.5 it
    stands (not half as busy); at 0.8 it is measured again and the higher figure kept, with the lower load, so the
    same load does not measure a third time; at 0.1 the CPU's own 0.40 replaces it, and is kept from then on. A
    cache written without loads is measured again once."""
    calls = []

    def fake(value):
        return lambda: calls.append(value) or value

    path, key = tmp_path / "cpu_peak.json", cpu_peak.cpu_key(cpu_peak.cpu_info(XEON), 2)
    assert cpu_peak.measured_tflops(key, fake(0.15), path, lambda: 2.0) == 0.15
    assert cpu_peak.measured_tflops(key, fake(0.30), path, lambda: 1.5) == 0.15
    assert cpu_peak.measured_tflops(key, fake(0.12), path, lambda: 0.8) == 0.15  # measured, lower: the 0.15 stays
    assert cpu_peak.measured_tflops(key, fake(0.30), path, lambda: 0.8) == 0.15  # that load was measured at
    assert cpu_peak.measured_tflops(key, fake(0.40), path, lambda: 0.1) == 0.40
    assert cpu_peak.measured_tflops(key, fake(0.20), path, lambda: 0.0) == 0.40
    assert calls == [0.15, 0.12, 0.40]
    path.write_text('{"%s": 0.15}' % key)
    assert cpu_peak.measured_tflops(key, fake(0.40), path, lambda: 1.0) == 0.40
    assert cpu_peak.measured_tflops(key, fake(0.50), path, lambda: 1.0) == 0.40
    assert calls == [0.15, 0.12, 0.40, 0.40]


def test_device_cpu_takes_this_machines_peak():
    peak = cpu_peak.cpu_peak_tflops()
    info = cpu_peak.cpu_info()
    import os

    assert peak >= cpu_peak.estimated_tflops(info, len(os.sched_getaffinity(0)), cpu_peak.clock_hz(info))
    cfg = compose_cfg("device=cpu")
    assert cfg.device.peak_tflops.fp32 == cfg.device.peak_tflops.fp16 == round(peak, 4)


def test_an_mfu_above_100_percent_is_said_once(capsys):
    """A peak below what the step computes (a fake one here): MFU = FLOPs/token x tokens/s / peak comes out above
    1, and the monitor says so once, naming device.peak_tflops; at a true peak it says nothing."""
    from trainer.metrics import SpeedMonitor

    model = load_preset("model", "tiny")
    probe = SpeedMonitor(model, 256, 1.0, 1)
    probe.start -= 1.0  # 1,000 tokens in (a little over) a second: FLOP/s just under FLOPs/token x 1,000
    probe.add(1000)
    flops = probe.measure()["mfu"] * 1e12  # at a 1 TFLOP/s peak, MFU x 1e12 is the step's FLOP/s
    for peak, over in ((flops / 1.5e12, True), (flops * 2 / 1e12, False)):  # MFU about 1.5 and 0.5 or less
        monitor = SpeedMonitor(model, 256, peak, 1)
        for _ in range(2):
            monitor.start -= 1.0
            monitor.add(1000)
            mfu = monitor.measure()["mfu"]
            assert (mfu > 1) == over and mfu < 1.6
        err = capsys.readouterr().err
        assert err.count("[speed] MFU") == int(over)
        if over:
            assert "is above 100%" in err and "device.peak_tflops" in err and len(err.strip().splitlines()) == 1
