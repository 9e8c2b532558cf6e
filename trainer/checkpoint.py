"""Checkpoints: <run_dir>/checkpoints/step_NNNNNN/{model,optimizer}.safetensors + state.json.

model.safetensors holds only the network's weights (what a converter or `stage.init_from` needs);
optimizer.safetensors the AdamW moments and update count; state.json the loop's host-side state.
A checkpoint is written to a temporary directory and renamed into place, so a complete-looking
directory is always complete. (Exact resume with data/RNG state and retention come with the checkpoint issue.)
"""
import json
import os
import shutil
import mindspore as ms
from mindspore import nn


def checkpoint_dir(run_dir: str, step: int) -> str:
    return os.path.join(run_dir, "checkpoints", f"step_{step:06d}")


def save(run_dir: str, step: int, model: nn.Cell, optimizer: nn.Optimizer, state: dict) -> str:
    final = checkpoint_dir(run_dir, step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    ms.save_checkpoint(model, os.path.join(tmp, "model.safetensors"), format="safetensors")
    weights = set(model.parameters_dict())
    ms.save_checkpoint(optimizer, os.path.join(tmp, "optimizer.safetensors"), format="safetensors",
                       choice_func=lambda name: name not in weights)
    with open(os.path.join(tmp, "state.json"), "w", encoding="utf-8") as f:
        json.dump({"step": step, **state}, f, indent=2)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def load_weights(path: str, model: nn.Cell) -> None:
    """Load model weights from a checkpoint dir (or a .safetensors file); every parameter must be present."""
    file = os.path.join(path, "model.safetensors") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"stage.init_from: no checkpoint at {file}")
    params = ms.load_checkpoint(file, format="safetensors")
    own = model.parameters_dict()
    missing = [name for name in own if name not in params]
    if missing:
        raise ValueError(f"stage.init_from: {file} lacks {len(missing)} parameters of this model, e.g. {missing[0]}")
    for name, param in own.items():
        if tuple(params[name].shape) != tuple(param.shape):
            raise ValueError(f"stage.init_from: {file} holds {name} with shape {tuple(params[name].shape)}, this "
                             f"model needs {tuple(param.shape)}: the checkpoint is of another model size")
    ms.load_param_into_net(model, params, strict_load=True)
