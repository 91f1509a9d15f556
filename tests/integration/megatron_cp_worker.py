"""One rank of the context-parallel checks; launched by test_megatron_cp.py.

The cases run through megatron_engine_worker.py's machinery (``run_case``: build, log-probs of this rank's rows,
update, export); this file only registers them. ``fsdp_cp_ref`` must run first in the process (the megatron
engine installs the CUDA->CPU shim, which the fsdp engine does not want).
"""

from __future__ import annotations

from tests.integration import megatron_engine_worker as worker

CP2 = ["actor.context_parallel_size=2"]
CASES = {
    # the reference: the fsdp engine over the same two ranks (data parallel, global normalisation)
    "fsdp_cp_ref": ("dense", ["actor.engine=fsdp"], ("update",)),
    "fsdp_cp_kl": ("dense", ["actor.engine=fsdp", *worker.KL], ("update",)),
    "dense_cp2": ("dense", CP2, ("log_probs", "export", "update")),
    "dense_cp2_kl": ("dense", [*CP2, *worker.KL], ("update",)),  # the frozen reference model runs under CP too
    "moe_cp2": ("moe", CP2, ("log_probs",)),
}
worker.CASES.update(CASES)

if __name__ == "__main__":
    worker.main()
