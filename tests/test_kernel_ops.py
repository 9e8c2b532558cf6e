"""benchmarks/kernel_ops.py calls the compiled kernels through ctypes at model=small's shapes: its calls give the
kernels' results, a call that does not match a kernel's signature is one clear error, and its parameter list is
model=small's."""
import math

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
