"""HF log-probs as the MindSpeed engine's reference, with a tolerance measured from their own fp32 rounding (#40).

The engine's log-probs and a plain transformers forward are two float32 evaluations of one function, in different
operation orders (megatron's layers, MindSpeed's fused kernels on the shim, TP / CP / EP splits, against
transformers' modules). Neither is exact, and how far each is from the exact value depends on the machine: the
fixed bound 1e-5 held on one box (max |diff| 7.2e-6) and failed on an AMD EPYC with AVX-512 (1.19e-5), whose
kernels round differently. So the bound is measured on the same tokens, on the machine that runs the test:

    noise = max over response tokens of |HF_fp32 - HF_fp64|

is HF's own fp32 error (float64 is exact to ~1e-15 here, far below it). With e_ours and e_HF the two fp32 errors
against the exact value,

    |ours - HF_fp32| = |e_ours - e_HF| <= |e_ours| + |e_HF| <= OURS_NOISE * noise + noise = TOL_NOISE * noise.

OURS_NOISE allows the engine 3x HF's error: it rounds at more places than HF (TP's split matmuls and their
all-reduce, CP's ring attention's rescaled partial sums, EP's token exchange, the shim's fused-kernel stand-ins),
each an fp32 rounding of the same size as HF's. Measured on the 2-core AMD EPYC (issue #40), over the batch's
response tokens: HF's noise on two threads 1.78e-5 (dense), 1.19e-5 (dense_kv2), 0.77e-5 and 1.05e-5 (two builds
of the MoE), i.e. HF's own fp32 error exceeds the old fixed 1e-5 on some; on one thread (as computed here) 6.4e-6
(dense) and 7.9e-6 (MoE), with ms_dense_tp1 4.05e-6 = 0.64x and ms_moe_tp1 6.7e-6 = 0.84x that noise from HF fp32
(bounds 2.5e-5, 3.2e-5); the layout case against two-thread HF fp32 1.19e-5 (the issue's failure, reproduced here
under the fixed bound). HF at 1 vs 2 threads differs by up to 3.8e-6 (MoE): half the noise, from the reduction
order alone. So TOL_NOISE = 4 (2.5-3.2e-5 here) is ~5x the engine's measured difference, and a bug (a wrong mask,
a missing scale, a token routed to another expert) moves log-probs by 1e-3 or more: 30x the bound and beyond.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

OURS_NOISE = 3  # the engine's fp32 error in units of HF's (see the module docstring)
TOL_NOISE = OURS_NOISE + 1
FP32_EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class Reference:
    log_probs: torch.Tensor  # [B, R] float32, HF's fp32 forward: what the engine is compared with
    noise: float  # max |HF_fp32 - HF_fp64| over the response tokens

    @property
    def tol(self) -> float:
        return TOL_NOISE * self.noise


def log_probs(model, batch, temperature: float, dtype: torch.dtype) -> torch.Tensor:
    """[B, R] log_softmax(logits / T) at each response token in ``dtype`` (the model's), one plain forward per
    sample (no padding, no packing, no cache): gspo_ascend.selftest.fixtures.hf_log_probs, kept in ``dtype`` so a
    float64 pass is not rounded to float32 on the way out."""
    out = torch.zeros(batch.response_ids.shape, dtype=dtype)
    with torch.no_grad():
        for i, prompt in enumerate(batch.prompt_ids):
            n = int(batch.response_mask[i].sum())
            response = batch.response_ids[i, :n].tolist()
            logits = model(torch.tensor([prompt + response])).logits[0].to(dtype)
            log_p = torch.log_softmax(logits / temperature, -1)[len(prompt) - 1 : len(prompt) - 1 + n]
            out[i, :n] = log_p.gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def _float64(model):
    """A float64 copy of ``model``. Its MoE experts run transformers' eager loop: transformers 5.5's default for them,
    ``grouped_mm`` (torch._grouped_mm), takes no float64 ("Expected mat_a to be Float32, BFloat16 or Float16"); the
    loop is the same per-expert matmuls, and the fp32 model keeps its own implementation."""
    exact = copy.deepcopy(model).double()
    if hasattr(exact, "set_experts_implementation") and getattr(exact.config, "num_experts", 0):
        exact.set_experts_implementation("eager")
    return exact


def hf_reference(model, batch, temperature: float) -> Reference:
    """The fp32 model's log-probs, and their fp32 noise against the same model in float64 (a copy), on one thread.

    One thread: torch's default is one per core, and the reduction order, so the fp32 result, changes with the
    count (measured here: HF's MoE log-probs at 1 vs 2 threads differ by up to 3.8e-6); with one, the reference is
    the same on a 2-core CI box and a 64-core one. And on a loaded 2-core box two OpenMP threads wait on each other
    at every op: this reference took 1.0-1.6 s on one thread and did not finish in 390 s on two beside
    ``stress --cpu 4``. The engine's ranks run one thread each too (OMP_NUM_THREADS=1, engine_worker.main)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ours32 = log_probs(model, batch, temperature, torch.float32)
        exact = log_probs(_float64(model), batch, temperature, torch.float64)
    finally:
        torch.set_num_threads(threads)
    mask = batch.response_mask.bool()
    noise = float((ours32.double() - exact)[mask].abs().max())
    # an fp32 error, not a broken reference: above one rounding of the largest log-prob, below 1e-4 (the engine
    # tests' log-probs reach |lp| ~ 10, fp32's ulp there is 1e-6; a few dozen roundings deep, not thousands)
    assert FP32_EPS * float(exact[mask].abs().max()) / 2 <= noise <= 1e-4, noise
    return Reference(ours32, noise)


def assert_rank_log_probs(ranks: dict, reference: Reference, batch) -> None:
    """Each rank's log-probs == the reference on the rows it holds (within reference.tol), exactly 0 at padding
    and not vacuous; the rows are split evenly over the ranks (tests/integration/test_megatron_engine.py's checks,
    with the measured tolerance)."""
    for result in ranks.values():
        start, stop = result["rows"]
        ours = result["log_probs"]
        assert ours.shape == (stop - start, batch.response_ids.shape[1]) and ours.dtype == torch.float32
        diff = float((ours - reference.log_probs[start:stop]).abs().max())
        assert diff <= reference.tol, f"|ours - HF| {diff:.3g} > {TOL_NOISE} x HF's fp32 noise {reference.noise:.3g}"
        assert torch.all(ours[batch.response_mask[start:stop] == 0] == 0)  # padding is exactly 0
        assert ours.abs().max() > 0.1  # real log-probs, not a vacuous match
    assert sorted(r["rows"][0] for r in ranks.values()) == [i * len(batch) // len(ranks) for i in range(len(ranks))]
