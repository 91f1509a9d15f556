"""gspo-ascend: GSPO RL post-training for Ascend NPUs, NVIDIA GPUs and CPU with one pipeline.

Importing this package is cheap and side-effect free apart from one environment default: a torch_npu
wheel installed without CANN breaks plain ``import torch`` through torch's device-backend auto-load entry
point, so we default ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (a no-op when torch is already imported) and
import torch_npu ourselves, guarded, when the npu backend is chosen (see gspo_ascend.device).
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

__version__ = "0.1.0"
