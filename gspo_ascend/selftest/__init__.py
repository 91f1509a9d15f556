"""``gspo-ascend selftest``: every layer of the pipeline on this node's own devices, each against the CPU reference CI
trusts, with the failing layer named. The first five minutes on an Atlas 800T A2 or an H20 node instead of finding
out 40 minutes into a 16-device job.

Layers, in order (one module each; every check is a :class:`.report.Result`: pass / fail / skip, seconds, detail,
fix): setup (device, versions, the tiny model), :mod:`.ops` (fused ops vs the shim's references), :mod:`.collectives`
(all-reduce / all-gather / broadcast, bus bandwidth; and on Ascend :mod:`.mc2`, the fused matmul + collective
ops), :mod:`.rollout` (hf and vLLM engines: generate, sleep / wake
up, weight update vs HF), :mod:`.training` (Megatron TP=2 vs HF, fsdp vs megatron step, checkpoint round trip) and
:mod:`.e2e` (two GSPO steps through Ray). :mod:`.cli` runs them; a failing check never stops the others.

How we differ from peers: ``gspo-ascend doctor`` (and verl's NPU plugin, which prints a patch summary, or
MindSpeed-RL, which has nothing comparable) inspect versions and environment without running anything on the
device; this runs the production code paths on it. Offline: the tiny model comes from ``make-tiny-model``.
"""
