"""Device targets are data: what a device runs (flash attention, bf16, semi-auto layouts, the CPU kernels and
FusedAdamW, the device twins, memory statistics) is its preset's capabilities (base/schema.py DeviceConfig), so a
preset defined here, and nowhere in the code, gets its behaviour; and no module compares a device's name or target
with a literal (read with `ast`)."""
import ast
from pathlib import Path

import numpy as np
import pytest
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from base.errors import ConfigError
from base.schema import DeviceConfig, as_device, use_flash_attention
from base.validate import validate_layout
from conftest import compose_cfg, load_preset
from helpers import REPO as ROOT, project_modules

DEVICE_NAMES = {"cpu", "gpu", "ascend"}

# a GPU whose MindSpore build had a FlashAttentionScore kernel: defined only here
FLASH_GPU = DeviceConfig(name="flash_gpu", target="GPU", compute_dtype="bf16", peak_tflops={"bf16": 100.0},
                         compute_efficiency=0.5, memory_gb=80, devices_per_node=8, accelerator=True, bf16=True,
                         flash_attention=True, semi_auto_parallel=True, memory_stats=True)
# a CPU without mindlab's kernels/ (another architecture) that takes Ascend-like device twins
PLAIN_CPU = DeviceConfig(name="plain_cpu", target="CPU", peak_tflops={"fp32": 0.1}, compute_efficiency=0.4,
                         memory_gb=8, device_ops=["ascend", "ascend-rope"])


# "path: comparison" -> why it is not a device capability
EXCEPTIONS = {
    "benchmarks/device_check.py: device != 'cpu'": "the check's fp32 reference run is the cpu preset, by its name",
    "benchmarks/device_check.py: device == 'cpu'": "the same reference run",
    "benchmarks/prepare_scale.py: 'cpu' in s": "'cpu' is the key of a step's CPU seconds, not a device",
}


def comparisons_with_devices(path: Path) -> list:
    """(line, source) of every comparison of a device name or target literal ('CPU', 'Ascend', 'GPU', any case), or
    of a `device.name` / `device.target` / `device_target` value, in the file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(_names_a_device(o) for o in [node.left, *node.comparators]):
            found.append((node.lineno, ast.unparse(node)))
    return found


def _names_a_device(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.lower() in DEVICE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_device(e) for e in node.elts)
    if isinstance(node, ast.Attribute):
        owner = node.value
        owner_name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
        return node.attr == "device_target" or (owner_name == "device" and node.attr in ("name", "target"))
    return isinstance(node, ast.Name) and node.id == "device_target"


def test_no_module_compares_a_device_name():
    found = {f"{path.relative_to(ROOT)}: {source}": line for _, _, path in project_modules()
             for line, source in comparisons_with_devices(path)}
    new = {key: line for key, line in found.items() if key not in EXCEPTIONS}
    assert not new, f"device capabilities belong in conf/device/*.yaml (base/schema.py DeviceConfig): {new}"
    stale = sorted(set(EXCEPTIONS) - set(found))
    assert not stale, f"EXCEPTIONS lists comparisons that are gone: {stale}"


def test_a_device_comparison_is_caught(tmp_path):
    path = tmp_path / "x.py"
    path.write_text('def f(cfg, t):\n    a = cfg.device.target == "Ascend"\n    b = t in ("gpu", "x")\n'
                    '    c = cfg.device.name != "cpu910"\n    return a, b, c, t == "ok"\n')
    assert [line for line, _ in comparisons_with_devices(path)] == [2, 3, 4]


@pytest.fixture(scope="module")
def presets():
    cs = ConfigStore.instance()
    for device in (FLASH_GPU, PLAIN_CPU):
        cs.store(group="device", name=device.name, node=device)
    return {d.name: OmegaConf.structured(d) for d in (FLASH_GPU, PLAIN_CPU)}


def test_a_preset_defined_in_a_test_decides_flash_attention_and_context_parallelism(presets):
    from models import attention_kind

    m = load_preset("model", "tiny")
    assert use_flash_attention(m, presets["flash_gpu"]) and not use_flash_attention(m, as_device("GPU"))
    assert attention_kind(m, presets["flash_gpu"], "bf16", False) == "flash"
    assert attention_kind(m, as_device("GPU"), "bf16", False) == "plain"
    overrides = ("model=tiny", "parallel.dp=1", "parallel.cp=2", "dry_run=true")
    validate_layout(compose_cfg("device=flash_gpu", *overrides))  # cp splits flash attention: this device has it
    with pytest.raises(ConfigError, match="parallel.cp"):
        validate_layout(compose_cfg("device=h100", *overrides))


def test_a_preset_defined_in_a_test_decides_the_kernels_twins_and_fused_adamw(presets):
    from mindspore import Parameter, Tensor

    from models.llama import device_passes, kernel_libraries
    from trainer import fused_adamw

    m, plain = load_preset("model", "tiny"), presets["plain_cpu"]
    assert kernel_libraries(m, "fp32", plain, False) == set()  # no kernels/ here, though the target is CPU
    assert not fused_adamw.applies([Parameter(Tensor(np.zeros(3, np.float32)), name="w")], plain, False)
    assert device_passes(m, plain, False) == {"ascend", "ascend-rope"}
    assert device_passes(m, plain, True) == {"ascend"}  # the RoPE twin needs the model outside a tp/pp layout
    assert device_passes(m, as_device("CPU"), False) == {"cpu"} and device_passes(m, as_device("GPU"), False) == set()
    with pytest.raises(ConfigError, match="precision"):  # bf16: the capability, not the target, refuses it
        validate_layout(compose_cfg("device=plain_cpu", "model=tiny", "precision=bf16", "dry_run=true"))
