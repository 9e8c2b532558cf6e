"""benchmarks/kernel_ops.py calls the compiled kernels through ctypes at model=small's shapes: its calls give the
kernels' results, a call that does not match a kernel's signature is one clear error, and its parameter list is
model=small's. And the kernels' threads (kernels/threads.h: workers started once and woken per call) give whole
results to two callers at once and to a forked child."""
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kernels
from benchmarks.kernel_ops import kernel_call, small_parameter_shapes
from conftest import load_preset
from models.llama.accounting import parameter_count

pytestmark = pytest.mark.skipif(kernels.library("layers")[0] is None, reason=kernels.library("layers")[1])


def test_a_call_runs_the_kernel_on_the_arrays_given():
    """RoPE through ctypes against numpy: y = x cos + rotate_half(x) sin, tables [S, 1, D] broadcast over heads."""
    rng = np.random.default_rng(0)
    x, cos, sin = (rng.standard_normal(shape, dtype=np.float32) for shape in ((2, 5, 3, 8), (5, 1, 8), (5, 1, 8)))
    y = np.zeros_like(x)
    kernel_call(kernels.library("layers")[0], "rope_forward", [x, cos, sin, y])()
    rotated = np.concatenate((-x[..., 4:], x[..., :4]), -1)
    np.testing.assert_allclose(y, x * cos + rotated * sin, rtol=1e-6, atol=1e-6)


def test_a_call_that_does_not_match_the_signature_is_one_error():
    x = np.zeros((2, 8), np.float32)
    call = kernel_call(kernels.library("layers")[0], "rope_forward", [x, x, x])  # no output array
    with pytest.raises(RuntimeError, match="mindlab_rope_forward .* returned an error"):
        call()


def test_the_parameter_list_is_model_smalls():
    model = load_preset("model", "small")
    shapes = small_parameter_shapes()
    assert len(shapes) == 2 + 9 * model.num_layers + 1
    assert sum(math.prod(s) for s in shapes) == parameter_count(model)["total"]


def swiglu(gate, up):
    """kernels/layers.cc's SwiGLU through ctypes; above threads.h's kThreadedWork it is split over the workers."""
    out = np.zeros_like(gate)
    kernel_call(kernels.library("layers")[0], "swiglu_forward", [gate, up, out])()
    return out


def silu_times(gate, up):
    return gate / (1 + np.exp(-gate)) * up


def test_two_callers_at_once_each_get_their_own_whole_result():
    """The workers serve one call at a time; a kernel called while they are busy (MindSpore runs independent kernels
    on threads of its own) runs all its parts itself. Two Python threads (ctypes releases the GIL), 200 calls each on
    their own inputs, each large enough to be split: every result whole and right, and neither caller stuck."""
    rng = np.random.default_rng(1)
    inputs = [rng.standard_normal((2, 1 << 17), dtype=np.float32) for _ in range(2)]
    wrong = []

    def calls(gate, up):
        want = silu_times(gate, up)
        for _ in range(200):
            if not np.allclose(swiglu(gate, up), want, rtol=1e-5, atol=1e-6):
                wrong.append(1)

    threads = [threading.Thread(target=calls, args=(gate, up)) for gate, up in inputs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a caller is stuck waiting for the workers"
    assert not wrong, f"{len(wrong)} of 400 calls gave a wrong result"


def test_a_forked_child_gets_workers_of_its_own():
    """A process that forks after the kernels ran (a data loader, a launcher) has none of its parent's workers: the
    child's first threaded call must start its own, not wait on the parent's forever."""
    script = textwrap.dedent("""
        import os, sys
        import numpy as np
        sys.path.insert(0, "tests")
        from test_kernel_ops import silu_times, swiglu
        gate, up = np.random.default_rng(0).standard_normal((2, 1 << 18), dtype=np.float32)
        def right():
            return np.allclose(swiglu(gate, up), silu_times(gate, up), rtol=1e-5, atol=1e-6)
        assert right()  # the parent's workers start here
        child = os.fork()
        if child == 0:
            os._exit(0 if right() else 3)
        sys.exit(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=root, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # its own process group: a stuck child is killed with it
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the forked child waited a minute for its parent's workers")
    assert proc.returncode == 0, err[-2000:]
