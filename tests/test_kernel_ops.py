"""kernels/probes/ops.py calls the compiled kernels through ctypes at model=small's shapes: its calls give the
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
from kernels.probes.ops import kernel_call, small_parameter_shapes
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


def _rotate_half_transposed(z):
    h = z.shape[-1] // 2
    return np.concatenate((z[..., h:], -z[..., :h]), -1)


def _backward_cases(rng):
    """{op: (inputs, output shapes, numpy float64 reference of the outputs)} at sizes the workers split, with rows of
    odd lengths: every output has partial 64-byte lines at its ends and at its rows' and ranges' ends."""
    def normal(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    gate, up, dy = normal(2, 40001), normal(2, 40001), normal(2, 40001)
    s = 1 / (1 + np.exp(-gate.astype(np.float64)))
    x, w, g = normal(300, 221), normal(221), normal(300, 221)
    inv = (1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-5)).astype(np.float32)
    dot = (w * g * x).astype(np.float64).sum(-1, keepdims=True)
    grad, cos, sin = normal(4, 301, 6, 10), normal(301, 1, 10), normal(301, 1, 10)
    logits, targets = normal(9, 8191), rng.integers(0, 8191, 9).astype(np.int32)
    targets[3] = -100  # an ignored row: zero gradient
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1)).astype(np.float32)
    dnll = normal(9)
    probs = np.exp(logits - lse[:, None].astype(np.float64)) * np.where(targets >= 0, dnll, 0)[:, None]
    probs[np.arange(9)[targets >= 0], targets[targets >= 0]] -= dnll[targets >= 0]
    return {
        "swiglu_backward": ([gate, up, dy], [gate.shape] * 2, [dy * up * s * (1 + gate * (1 - s)), dy * gate * s]),
        "rms_norm_backward": ([x, w, inv, g], [x.shape, w.shape],
                              [inv[:, None] * w * g - x * inv[:, None] ** 3 * dot / 221,
                               (g * x * inv[:, None]).astype(np.float64).sum(0)]),
        "rope_backward": ([grad, cos, sin], [grad.shape], [grad * cos + _rotate_half_transposed(grad * sin)]),
        "cross_entropy_backward": ([logits, targets, lse, dnll], [logits.shape], [probs]),
    }


@pytest.mark.parametrize("op", ["swiglu_backward", "rms_norm_backward", "rope_backward", "cross_entropy_backward"])
def test_the_backward_kernels_write_whole_outputs_wherever_they_start(op):
    """The backward kernels write whole 64-byte lines by non-temporal stores and the partial lines at the ends by
    plain ones (kernels/stream.h). Outputs starting at each of a line's 16 floats: every element right, and the
    floats just before and after each output untouched."""
    inputs, shapes, want = _backward_cases(np.random.default_rng(2))[op]
    for shift in range(16):
        bufs, outs = [], []
        for shape in shapes:
            n = math.prod(shape)
            buf = np.full(n + 48, np.nan, np.float32)
            start = (-buf.ctypes.data % 64) // 4 + shift + 1  # a guard float before the output, more after it
            bufs.append((buf, start, n))
            outs.append(buf[start:start + n].reshape(shape))
        kernel_call(kernels.library("layers")[0], op, [*inputs, *outs])()
        for out, ref in zip(outs, want):
            np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5, err_msg=f"{op}, output at float {shift}")
        for buf, start, n in bufs:
            assert np.isnan(buf[start - 1]) and np.isnan(buf[start + n]), \
                f"{op} wrote outside its output (starting at float {shift} of a line)"
