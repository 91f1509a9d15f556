"""One side of the CPU comparison in this folder's README: benchmarks/train_throughput.py, megatron engine, small shape,
fp32, with the SDPA core attention (``sdpa``, the engine's default without TE and MindSpeed) or with the local spec's
own DotProductAttention (``local``: the swap switched off, as before issue #43).

    .venv/bin/python docs/results/cpu-megatron-sdpa/run.py sdpa|local OUT.json
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
side, out = sys.argv[1], sys.argv[2]
if side == "local":
    from gspo_ascend.engines import megatron_attention

    megatron_attention.use_sdpa_attention = lambda bridge: None
from benchmarks import train_throughput  # noqa: E402  (after the switch above, as a side needs)

sys.exit(
    train_throughput.main(
        ["--engine", "megatron", "--shape", "small", "--dtype", "float32", "--steps", "3", "--json", out]
    )
)
