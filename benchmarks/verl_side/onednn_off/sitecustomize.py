"""Our side with vLLM's oneDNN linears off (``ours-vllm-noonednn`` in benchmarks/e2e_sides.py): the handicap shim P4
puts on verl's rollout, put on ours too, so the ours / verl ratio is not one the shim created.

On ``PYTHONPATH`` for that side only; Python imports ``sitecustomize`` at start-up in every process the side starts
(Ray's worker, vLLM's engine core), and the hook sets ``vllm._custom_ops._supports_onednn = False`` when vLLM loads.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shims"))
import verl_cpu_shims  # noqa: E402,F401  (P4 only: the verl hooks never fire without verl)

sys.path.pop(0)
