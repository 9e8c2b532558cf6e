"""Import this first, before anything else from mindlab: process-wide set-up that must precede other imports.

- MindSpore is imported before anything that loads protobuf (wandb, tensorboardX): the other order crashes
  the process ("Descriptors cannot be created directly").
- MindFormers writes its logs to ./output/log/ at import time unless LOCAL_DEFAULT_PATH points elsewhere.
"""
import os
import tempfile

os.environ.setdefault("LOCAL_DEFAULT_PATH", os.path.join(tempfile.gettempdir(), "mindlab-mindformers-logs"))
os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ log: errors only

import mindspore  # noqa: E402,F401  (see the module docstring)
