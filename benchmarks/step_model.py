"""A discrete-event model of GSPO step time: colocated synchronous vs disaggregated one-step-off, each with and
without partial rollout (issue #28 item 4b). A model, not a measurement: it predicts, it proves nothing.

    python benchmarks/step_model.py --preset qwen3-30b-a3b-atlas-2x8     # or qwen3-30b-a3b-h20-2x8, realistic-cpu
    python benchmarks/step_model.py --preset realistic-cpu --steps 200 --seed 1

What is simulated. Generation, event by event: each step's requests (one per unfinished sample; with partial
rollout, at most ``round_tokens`` new tokens a round) are split in contiguous chunks, oldest first, over the rollout
replicas (``rollout_tp`` devices each), as our ``WorkerGroup.generate`` splits a batch. A replica admits requests
FIFO up to ``max_concurrency`` (its KV cache), pays their prefill at ``prefill_tps``, and decodes its running batch
one token per sequence per step; a step takes ``b / decode_tps(b)`` at concurrency ``b`` (the table, interpolated).
So the tail of a long-tailed batch runs at low concurrency, where a step costs almost what a full one does: that
is what makes the tail expensive, and what partial rollout cuts. A round ends when its slowest replica ends.
Partial rollout follows ``gspo_ascend/partial_rollout.py``: ``B + extra_groups`` groups in flight, rounds until the
``B`` oldest groups are finished, train on those (FIFO); a continuation re-prefills prompt + tokens so far, a
fresh sample pays ``prompt / n`` (the n samples of a request share their prompt's prefill).

Training is ``trained tokens / (tokens/s per device x devices)`` for the update plus the same for the old
log-probs (0 with ``old_logprobs=engine``); the attention's growth with length is folded into the rate. The sync
moves ``weight_bytes`` at ``sync_gbps``.

Schedules (step k trains batch k):
- colocated: every device generates, then trains, then syncs: ``step = gen + switch + old_lp + update + sync``
  (``switch``: the actor state offloaded to host and back, ``actor.offload``);
- one-step-off (eta = 1, verl's ``one_step_off_policy``): sync k (weights v_{k-1}) starts when the rollout pool has
  finished batch k and the trainer has finished batch k-1; then the trainer trains batch k while the rollout pool
  generates batch k+1: ``s_{k+1} = s_k + max(sync_t + train_k, sync_r + gen_{k+1})``, where ``sync_t`` / ``sync_r``
  are the transfer plus each side's own part (export / load). Idle = waiting on the other pool (sync excluded).

How it differs from verl's rule of thumb (docs/advance/one_step_off.md: step ~ wait_prev_gen + old_log_prob +
update_actor, tune the split until rollout time ~ train time): that rule describes a measured step after the
fact; this derives gen time from a decode-throughput curve and the length distribution, so it can say *before* a
run what a split or ``round_tokens`` does to it: the tail at low concurrency (why more rollout devices stop
helping: the longest response's decode steps do not parallelise), the replica imbalance, the KV-cache cap, the
re-prefill of continuations, and the sync that both pools wait for each step, which the rule leaves out.

Closed forms the tests check (tests/unit/test_step_model.py): with constant lengths and a throughput that does
not depend on concurrency, colocated step = gen + train + sync exactly and one-step-off = max(gen + sync_r,
train + sync_t); ``round_tokens >= max_response`` with no extra groups is the synchronous step, time for time.

Why one file over 600 lines: the model, its presets with their sources and its report are one script over numpy
alone, which a cluster user can copy and run without the package; the tests above hold the model as a whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field

import numpy as np

SCHEDULES = ("colocated", "one-step-off")


@dataclass(frozen=True)
class Inputs:
    """Everything the model needs; rates are per rollout replica or per trainer device. ``sources``: field -> where
    the figure comes from (printed by the CLI)."""

    name: str
    prompts_per_step: int  # B, data.train_batch_size
    group_size: int  # n
    prompt_tokens: float  # mean prompt length
    max_response: int
    decode_batch: tuple[float, ...]  # concurrency points of one replica ...
    decode_tps: tuple[float, ...]  # ... and its decode tokens/s there (interpolated, clamped at the ends)
    prefill_tps: float  # tokens/s of one replica
    train_tps: float  # update (fwd + bwd + optimizer) tokens/s per trainer device
    old_logprob_tps: float  # recompute tokens/s per trainer device; math.inf = old_logprobs=engine
    weight_bytes: float
    sync_gbps: float  # between pools (disaggregated)
    colocated_sync_gbps: float  # in place (colocated: every device updates its own engine)
    total_devices: int
    rollout_tp: int  # devices per rollout replica
    max_concurrency: int  # sequences per replica, colocated (KV cache beside the offloaded actor)
    max_concurrency_disagg: int  # sequences per replica in a rollout-only pool (no actor state: more KV)
    min_trainer_devices: int = 1  # the smallest trainer pool whose training state fits (memory planner)
    colocated_switch_s: float = 0.0  # colocated: actor state to host before rollout and back after (per step)
    sync_trainer_extra_s: float = 0.0  # trainer-side part of a sync (export / gather), disaggregated
    sync_rollout_extra_s: float = 0.0  # rollout-side part (load into the engine), disaggregated
    length_samples: tuple[int, ...] = ()  # response lengths to draw from (with replacement); else the lognormal
    length_median: float = 0.0
    length_sigma: float = 0.0
    length_min: int = 1
    round_tokens: int | None = None  # partial rollout: None = off
    max_rounds: int = 2
    extra_groups: int | None = None  # None = (max_rounds - 1) x B, the most allowed
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def draw_lengths(self, rng: np.random.Generator, size: int) -> np.ndarray:
        if self.length_samples:
            out = rng.choice(np.asarray(self.length_samples), size=size)
        else:
            out = np.rint(rng.lognormal(math.log(self.length_median), self.length_sigma, size=size))
        return np.clip(out, self.length_min, self.max_response).astype(np.int64)

    def step_time(self, b: int) -> float:
        """Seconds for one decode step of a replica running ``b`` sequences."""
        return b / float(np.interp(b, self.decode_batch, self.decode_tps))

    def with_partial(self, round_tokens: int | None, **kw) -> Inputs:
        return dataclasses.replace(self, round_tokens=round_tokens, **kw)


# ---------------------------------------------------------------------------------------------- generation


def replica_time(inp: Inputs, decode: np.ndarray, prefill: np.ndarray, cap: int) -> float:
    """Busy time of one replica serving ``decode[i]`` new tokens after ``prefill[i]`` prompt tokens, FIFO, at most
    ``cap`` sequences at once; between two finishes the concurrency is constant, so time advances finish to finish."""
    t, nxt, running = 0.0, 0, np.zeros(0, dtype=np.int64)
    while nxt < len(decode) or running.size:
        room = cap - running.size
        if room > 0 and nxt < len(decode):
            take = slice(nxt, min(nxt + room, len(decode)))
            t += float(prefill[take].sum()) / inp.prefill_tps
            running = np.concatenate([running, decode[take]])
            nxt = take.stop
        m = int(running.min())
        t += m * inp.step_time(running.size)
        running = running[running > m] - m
    return t


def round_time(inp: Inputs, decode: np.ndarray, prefill: np.ndarray, replicas: int, cap: int) -> list[float]:
    """Per-replica busy time of one generate call: requests split in contiguous chunks, oldest first."""
    idx = np.array_split(np.arange(len(decode)), replicas)
    return [replica_time(inp, decode[i], prefill[i], cap) if len(i) else 0.0 for i in idx]


@dataclass
class _Group:
    target: np.ndarray  # each sample's final length
    done: np.ndarray  # tokens generated so far
    rounds: np.ndarray  # rounds each sample has had


@dataclass
class GenStep:
    gen_s: float
    rounds: int
    trained_tokens: float
    replica_idle: float  # share of replica-time in this step's rounds spent waiting for the slowest replica


class Generator:
    """The rollout side of one run: the groups in flight and the rounds of each step (partial or not)."""

    def __init__(self, inp: Inputs, replicas: int, cap: int, rng: np.random.Generator):
        self.inp, self.replicas, self.cap, self.rng = inp, replicas, cap, rng
        self.flight: list[_Group] = []

    def _extra(self) -> int:
        inp = self.inp
        if inp.round_tokens is None:
            return 0
        return (inp.max_rounds - 1) * inp.prompts_per_step if inp.extra_groups is None else inp.extra_groups

    def _requests(self) -> tuple[list[tuple[_Group, np.ndarray]], np.ndarray, np.ndarray]:
        inp, picks, dec, pre = self.inp, [], [], []
        for g in self.flight:
            live = np.flatnonzero(g.done < g.target)
            if not live.size:
                continue
            left = g.target[live] - g.done[live]
            last = g.rounds[live] + 1 >= inp.max_rounds
            budget = left if inp.round_tokens is None else np.where(last, left, np.minimum(left, inp.round_tokens))
            fresh = g.done[live] == 0
            pre.append(np.where(fresh, inp.prompt_tokens / inp.group_size, inp.prompt_tokens + g.done[live]))
            dec.append(budget)
            picks.append((g, live))
        if not dec:
            return [], np.zeros(0, dtype=np.int64), np.zeros(0)
        return picks, np.concatenate(dec), np.concatenate(pre)

    def step(self) -> GenStep:
        inp, b = self.inp, self.inp.prompts_per_step
        while len(self.flight) < b + self._extra():
            t = self.inp.draw_lengths(self.rng, inp.group_size)
            self.flight.append(_Group(t, np.zeros_like(t), np.zeros_like(t)))
        gen, rounds, idle, busy = 0.0, 0, 0.0, 0.0
        while True:
            picks, dec, pre = self._requests()
            if dec.size:
                times = round_time(inp, dec, pre, self.replicas, self.cap)
                gen += max(times)
                idle += self.replicas * max(times) - sum(times)
                busy += self.replicas * max(times)
                at = 0
                for g, live in picks:
                    g.done[live] += dec[at : at + live.size]
                    g.rounds[live] += 1
                    at += live.size
            rounds += 1
            if all((g.done >= g.target).all() for g in self.flight[:b]) or not dec.size:
                break
        trained, self.flight = self.flight[:b], self.flight[b:]
        tokens = sum(float(g.target.sum()) + inp.prompt_tokens * inp.group_size for g in trained)
        return GenStep(gen, rounds, tokens, idle / busy if busy else 0.0)


# ---------------------------------------------------------------------------------------------- schedules


@dataclass
class StepRecord:
    gen_s: float
    train_s: float
    sync_s: float
    wall_s: float
    trainer_idle_s: float
    rollout_idle_s: float
    rounds: int
    replica_idle: float


@dataclass
class Summary:
    schedule: str
    partial: bool
    rollout_devices: int
    trainer_devices: int
    gen_s: float
    train_s: float
    sync_s: float
    step_s: float
    trainer_idle: float  # ratio of wall time, steady state
    rollout_idle: float
    rounds: float
    replica_idle: float
    steps: list[StepRecord] = field(default_factory=list, repr=False)


def train_time(inp: Inputs, tokens: float, devices: int) -> float:
    return tokens / (inp.train_tps * devices) + tokens / (inp.old_logprob_tps * devices)


def simulate(
    inp: Inputs, schedule: str, rollout_devices: int, trainer_devices: int, steps: int = 60, seed: int = 0, warmup=3
) -> Summary:
    """``steps`` steps of one schedule; the averages skip the first ``warmup`` (empty pipeline, first rounds).
    colocated: every device is in both pools (pass the total twice)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: one of {SCHEDULES}")
    colo = schedule == "colocated"
    cap = inp.max_concurrency if colo else inp.max_concurrency_disagg
    gen = Generator(inp, rollout_devices // inp.rollout_tp, cap, np.random.default_rng(seed))
    records = _colocated(inp, gen, trainer_devices, steps) if colo else _one_step_off(inp, gen, trainer_devices, steps)
    keep = records[min(warmup, len(records) - 1) :]

    def mean(attr: str) -> float:
        return statistics.fmean(getattr(r, attr) for r in keep)

    wall = mean("wall_s")
    return Summary(
        schedule, inp.round_tokens is not None, rollout_devices, trainer_devices, mean("gen_s"), mean("train_s"),
        mean("sync_s"), wall, mean("trainer_idle_s") / wall, mean("rollout_idle_s") / wall, mean("rounds"),
        mean("replica_idle"), records,
    )  # fmt: skip


def _colocated(inp: Inputs, gen: Generator, devices: int, steps: int) -> list[StepRecord]:
    sync = inp.weight_bytes / (inp.colocated_sync_gbps * 1e9) + inp.colocated_switch_s
    out = []
    for _ in range(steps):
        g = gen.step()
        train = train_time(inp, g.trained_tokens, devices)
        out.append(StepRecord(g.gen_s, train, sync, g.gen_s + train + sync, 0.0, 0.0, g.rounds, g.replica_idle))
    return out


def _one_step_off(inp: Inputs, gen: Generator, devices: int, steps: int) -> list[StepRecord]:
    """s_{k+1} = s_k + max(sync_t + train_k, sync_r + gen_{k+1}); the first generation (v0) is warm-up."""
    transfer = inp.weight_bytes / (inp.sync_gbps * 1e9)
    sync_t, sync_r = transfer + inp.sync_trainer_extra_s, transfer + inp.sync_rollout_extra_s
    batch = gen.step()  # batch 1, generated before the loop with the initial weights
    out = []
    for _ in range(steps):
        nxt = gen.step()  # batch k+1, generated while batch k trains
        train = train_time(inp, batch.trained_tokens, devices)
        wall = max(sync_t + train, sync_r + nxt.gen_s)
        idle_t, idle_r = wall - sync_t - train, wall - sync_r - nxt.gen_s
        out.append(StepRecord(nxt.gen_s, train, transfer, wall, idle_t, idle_r, nxt.rounds, nxt.replica_idle))
        batch = nxt
    return out


def splits(inp: Inputs, total: int | None = None) -> list[tuple[int, int]]:
    """(rollout, trainer) device splits in multiples of the replica size, every one, feasible or not."""
    total = inp.total_devices if total is None else total
    return [(r, total - r) for r in range(inp.rollout_tp, total, inp.rollout_tp)]


def table(inp: Inputs, steps: int = 60, seed: int = 0, round_tokens: int | None = None) -> list[Summary]:
    """Every schedule x split, without and with partial rollout (``round_tokens``: default half the limit)."""
    rt = round_tokens or inp.round_tokens or inp.max_response // 2
    out = []
    for variant in (inp.with_partial(None), inp.with_partial(rt)):
        out.append(simulate(variant, "colocated", inp.total_devices, inp.total_devices, steps, seed))
        for r, t in splits(inp):
            out.append(simulate(variant, "one-step-off", r, t, steps, seed))
    return out


@dataclass
class Recommendation:
    rollout_devices: int
    trainer_devices: int
    partial: bool
    step_s: float
    trainer_idle: float
    rollout_idle: float
    colocated_step_s: float  # the colocated baseline, same partial setting
    speedup: float
    considered: list[Summary]


def recommend_split(
    inp: Inputs, total_devices: int | None = None, steps: int = 60, seed: int = 0, partial: bool | None = None
) -> Recommendation:
    """The rollout:trainer split (multiples of the replica size, trainer pool >= ``min_trainer_devices``) whose
    one-step-off steady-state step is shortest; ``partial``: None tries both and keeps the better."""
    total = inp.total_devices if total_devices is None else total_devices
    variants = [False, True] if partial is None else [partial]
    best, considered = None, []
    for p in variants:
        v = inp.with_partial((inp.round_tokens or inp.max_response // 2) if p else None)
        base = simulate(v, "colocated", total, total, steps, seed)
        considered.append(base)
        for r, t in splits(inp, total):
            if t < inp.min_trainer_devices:
                continue
            s = simulate(v, "one-step-off", r, t, steps, seed)
            considered.append(s)
            if best is None or s.step_s < best[0].step_s:
                best = (s, base)
    if best is None:
        raise ValueError(f"no split of {total} devices leaves >= {inp.min_trainer_devices} to the trainer")
    s, base = best
    return Recommendation(
        s.rollout_devices, s.trainer_devices, s.partial, s.step_s, s.trainer_idle, s.rollout_idle, base.step_s,
        base.step_s / s.step_s, considered,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- derived inputs


def roofline_decode(
    batches: tuple[float, ...], *, dense_bytes: float, kv_bytes_per_token: float, context: float, hbm_bytes_s: float,
    flops_per_token: float, flops_s: float, overhead_s: float, expert_bytes: float = 0.0, experts: int = 0, top_k=0,
) -> tuple[float, ...]:  # fmt: skip
    """Decode tokens/s of one replica at each concurrency b, roofline style: a step reads the dense weights, the
    experts that b tokens route to (b x top_k draws of ``experts``: a fraction 1 - (1 - k/E)^b of them), and b
    sequences' KV cache of ``context`` tokens, at ``hbm_bytes_s`` (bandwidth x efficiency, summed over the
    replica's devices), or computes 2 x active params per token at ``flops_s``, whichever is slower, plus a fixed
    ``overhead_s`` (kernel launches, TP / EP collectives, sampling)."""
    out = []
    for b in batches:
        touched = 1 - (1 - top_k / experts) ** b if experts else 0.0
        read = dense_bytes + expert_bytes * touched + b * context * kv_bytes_per_token
        out.append(b / (max(read / hbm_bytes_s, b * flops_per_token / flops_s) + overhead_s))
    return tuple(out)


def linear_decode(batches: tuple[float, ...], fixed_s: float, per_seq_s: float) -> tuple[float, ...]:
    """Decode tokens/s when a step costs ``fixed_s + per_seq_s x b`` (what a CPU engine measures)."""
    return tuple(b / (fixed_s + per_seq_s * b) for b in batches)


def clipped_lognormal_mean(median: float, sigma: float, cap: float) -> float:
    """E[min(X, cap)] for X lognormal with that median and sigma."""
    mu, phi = math.log(median), lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    z = (math.log(cap) - mu) / sigma
    return math.exp(mu + sigma**2 / 2) * phi(z - sigma) + cap * (1 - phi(z))


def fit_sigma(median: float, mean: float, cap: float) -> float:
    """The sigma whose lognormal (given median) clipped at ``cap`` has ``mean`` (bisection)."""
    lo, hi = 1e-6, 5.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if clipped_lognormal_mean(median, mid, cap) < mean else (lo, mid)
    return (lo + hi) / 2


BATCHES = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)
# Qwen3-30B-A3B from its config.json (gspo_ascend/doctor/model_specs.json): 48 layers, hidden 2048, 32 / 4 heads x
# 128, 128 experts top-8 of 3 x 2048 x 768, vocab 151,936 untied. Counted here, bf16.
Q30_EXPERT_PARAMS = 48 * 128 * 3 * 2048 * 768  # 28.99 B
Q30_DENSE_READ = 48 * (2048 * 128 * (2 * 32 + 2 * 4) + 2048 * 128) + 151936 * 2048  # attention, routers, lm_head
Q30_TOTAL_PARAMS = Q30_EXPERT_PARAMS + 48 * (2048 * 128 * 72 + 2048 * 128 + 4 * 2048) + 2 * 151936 * 2048
Q30_ACTIVE = 48 * (2048 * 128 * 72 + 2048 * 128 + 8 * 3 * 2048 * 768)  # non-embedding active params: 2.73 B
Q30_KV_BYTES = 2 * 48 * 4 * 128 * 2  # K and V, every layer, 4 KV heads x 128, bf16: 96 KiB per token


def q30_train_flops(context: float) -> float:
    """Model FLOPs per trained token, benchmarks/train_throughput.py's convention: 6 N + 6 V h + 12 L H d C."""
    return 6 * Q30_ACTIVE + 6 * 151936 * 2048 + 12 * 48 * 32 * 128 * context


def _q30_sources(atlas: bool, median: float, sigma: float, mean_resp: float, ctx: float, sync: float) -> dict:
    ref, cfg, plan = "../shared/reference/async-rollout-peers.md", "configs/qwen3_30b_a3b_gspo.yaml", "gspo-ascend plan"
    hbm, eff, tflops, overhead, mfu = _Q30_HW[atlas]
    at_limit = 100 * (1 - 0.5 * (1 + math.erf(math.log(8192 / median) / sigma / math.sqrt(2))))
    chip = "Ascend 910B (Atlas 800T A2)" if atlas else "NVIDIA H20"
    # fmt: off
    return {
        "prompts_per_step": f"{cfg} (data.train_batch_size 128, rollout.n 8)",
        "max_response": f"{cfg} (data.max_response_length 8192)",
        "prompt_tokens": "assumed 256: DAPO math prompts with the chat template are short (max_prompt_length 2048)",
        "lengths": f"assumed lognormal, median {median} (a quarter of the limit), sigma {sigma:.3f} fitted to the "
        f"realistic benchmark's mean/median 105/77 at its 512 limit (benchmarks/README.md); mean {mean_resp:.0f}, "
        f"{at_limit:.1f}% at the limit. Reasonable: RL math responses are long-tailed alike; replace with a trace",
        "rollout_tp": f"{cfg} (rollout.tensor_parallel_size 4)",
        "decode": f"roofline_decode: {hbm / 1e12:.1f} TB/s HBM per {chip} (vendor datasheet; not in "
        f"../shared/reference) x efficiency {eff} (assumed: MoE gathers and small decode GEMMs rarely pass 50-60% of "
        f"peak), TP 4; weights read per step from Qwen3-30B-A3B's config (model_specs.json); KV 96 KiB/token at "
        f"context {ctx:.0f} (prompt + half the mean response); step overhead {overhead * 1e3:.0f} ms (assumed: "
        + ("eager on NPU, the config's enforce_eager auto: ~1000 kernel launches a step over 48 layers)" if atlas
           else "CUDA graphs on GPU; 2 TP all-reduces per layer)"),
        "prefill_tps": f"compute bound: 2 x active params per token at 30% (assumed) of {tflops / 1e12:.0f} TFLOP/s "
        "x TP 4 (peak: vendor datasheet" + ("" if atlas else "; benchmarks/train_throughput.py PEAK_TFLOPS") + ")",
        "train_tps": f"MFU {mfu} (assumed: Megatron MoE, full recompute; "
        + ("MindSpeed on 910B below GPUs" if atlas else "H20's low peak makes a higher MFU easier")
        + f") x {tflops / 1e12:.0f} TFLOP/s / {q30_train_flops(128 + mean_resp / 2) / 1e9:.1f} GFLOP per token "
        "(6N + 6Vh + 12LHdC, benchmarks/train_throughput.py)",
        "old_logprob_tps": "3 x train_tps (assumed: a forward is a third of fwd + bwd); old_logprobs=recompute, "
        "the default",
        "weight_bytes": f"{2 * Q30_TOTAL_PARAMS / 1e9:.1f} GB: Qwen3-30B-A3B in bf16 (model_specs.json)",
        "sync_gbps": f"5.3 GB/s: verl checkpoint engine, HCCL, 2x16 Ascend 910C ({ref} 1.2); 910B assumed alike"
        if atlas else f"{sync:.1f} GB/s: verl's checkpoint engine synced Qwen3-30B-A3B 16+16 H20 in 4.38 s ({ref} 1.2)",
        "colocated_sync_gbps": "assumed equal to sync_gbps (the same bytes gathered and loaded; not measured)",
        "colocated_switch_s": f"actor state ~33 GiB/device ({plan}, shipped config) to host and back "
        + ("at ~25 GB/s (assumed PCIe 4.0 x16)" if atlas else "at ~50 GB/s (assumed PCIe 5.0 x16)"),
        "max_concurrency": f"KV cache of {_Q30_KV[atlas]:,} tokens per engine ({plan} --hardware "
        f"{'atlas-800t-a2' if atlas else 'h20'}) / 10,240 (full-length sequences: conservative, vLLM admits by use)",
        "max_concurrency_disagg": "assumed twice the colocated KV (a rollout-only device can raise "
        "gpu_memory_utilization from 0.5 to ~0.8), at most vLLM's max_num_seqs 256",
        "min_trainer_devices": f"{plan}: " + ("8 Atlas devices OOM (66.8 GiB of 60.0), 12 fit (51.5 GiB at TP2 PP6 "
        "EP2: the disaggregated config, every group within a node's 6)"
        if atlas else "8 H20 fit (66.8 GiB of 94.6); 4 is no layout (TP4 x PP2 = 8)"),
        "total_devices": "2 nodes x 8 (scripts/npu/qwen3_30b_gspo.sh, scripts/gpu/qwen3_30b_gspo.sh)",
    }
    # fmt: on


# HBM bytes/s and its efficiency, bf16 dense FLOP/s, decode step overhead (s), training MFU; KV tokens per engine
_Q30_HW = {True: (1.6e12, 0.5, 313e12, 0.040, 0.15), False: (4.0e12, 0.6, 148e12, 0.010, 0.25)}
_Q30_KV = {True: 558_713, False: 1_457_422}


def _q30_preset(hw: str) -> Inputs:
    atlas, prompt, rmax, tp = hw == "atlas", 256, 8192, 4
    hbm, eff, tflops, overhead, mfu = _Q30_HW[atlas]
    median, sigma = 2048, fit_sigma(77, 105, 512)  # the realistic shape's spread, scaled (see the sources)
    mean_resp = clipped_lognormal_mean(median, sigma, rmax)
    ctx = prompt + mean_resp / 2
    train_tps = mfu * tflops / q30_train_flops(prompt / 2 + mean_resp / 2)
    sync = 5.3 if atlas else 2 * Q30_TOTAL_PARAMS / 4.38 / 1e9
    curve = roofline_decode(
        BATCHES, dense_bytes=2 * Q30_DENSE_READ, expert_bytes=2 * Q30_EXPERT_PARAMS, experts=128, top_k=8,
        kv_bytes_per_token=Q30_KV_BYTES, context=ctx, hbm_bytes_s=tp * hbm * eff,
        flops_per_token=2 * (Q30_ACTIVE + 151936 * 2048), flops_s=tp * tflops * 0.5, overhead_s=overhead,
    )  # fmt: skip
    return Inputs(
        name=f"qwen3-30b-a3b-{hw}-2x8", prompts_per_step=128, group_size=8, prompt_tokens=prompt, max_response=rmax,
        decode_batch=BATCHES, decode_tps=curve,
        prefill_tps=0.3 * tp * tflops / (2 * (Q30_ACTIVE + 151936 * 2048)), train_tps=train_tps,
        old_logprob_tps=3 * train_tps, weight_bytes=2 * Q30_TOTAL_PARAMS, sync_gbps=sync, colocated_sync_gbps=sync,
        total_devices=16, rollout_tp=tp, max_concurrency=min(256, _Q30_KV[atlas] // 10240),
        max_concurrency_disagg=min(256, 2 * _Q30_KV[atlas] // 10240), min_trainer_devices=12 if atlas else 8,
        colocated_switch_s=2 * 33 * 2**30 / (25e9 if atlas else 50e9), length_median=median, length_sigma=sigma,
        length_min=16, sources=_q30_sources(atlas, median, sigma, mean_resp, ctx, sync),
    )  # fmt: skip


def inputs_from_measurements(
    *, decode_fixed_s: float, decode_per_seq_s: float, update_s: float, update_tokens: float, sync_s: float,
    lengths: tuple[int, ...] = (), old_logprob_s: float = 0.0, **inputs,
) -> Inputs:  # fmt: skip
    """Inputs from per-stage figures measured on one device (a simulated-latency engine's parameters, or a
    trace): a decode step of ``decode_fixed_s + decode_per_seq_s x b``, the update's seconds for
    ``update_tokens``, the old log-probs' (0: from the engine), the sync's seconds, measured ``lengths``; the
    rest are :class:`Inputs` fields (defaults: one device per replica, the same sync in place and between pools)."""
    inputs.setdefault("weight_bytes", 1e9)
    gbps = inputs["weight_bytes"] / sync_s / 1e9
    defaults = dict(name="measured", rollout_tp=1, total_devices=2, max_concurrency=256, sync_gbps=gbps)
    for k, v in defaults.items():
        inputs.setdefault(k, v)
    inputs.setdefault("max_concurrency_disagg", inputs["max_concurrency"])
    return Inputs(
        decode_batch=BATCHES, decode_tps=linear_decode(BATCHES, decode_fixed_s, decode_per_seq_s),
        train_tps=update_tokens / update_s, colocated_sync_gbps=inputs["sync_gbps"],
        old_logprob_tps=update_tokens / old_logprob_s if old_logprob_s else math.inf,
        length_samples=tuple(lengths), **inputs,
    )  # fmt: skip


def simulate_from_measurements(steps: int = 60, seed: int = 0, **measured) -> list[Summary]:
    """Every schedule x split for :func:`inputs_from_measurements` (the model's side of a validation run against
    the pipeline with simulated-latency engines, issue #28 item 4a: must agree within 10%)."""
    return table(inputs_from_measurements(**measured), steps, seed)


# The realistic shape's partial-rollout run (benchmarks/README.md, issue #27): generate 17.68 s synchronous and
# 14.94 s with round_tokens=256, mean response 107.3 / 107.8 tokens, update 17.1 s, on 16 x 8 samples. A decode
# step of a + c b fitted to the pair: a synchronous step runs ~512 decode steps, a partial round ~256, over the
# same ~13.7k tokens, so 256 a = 17.68 - 14.94 and c = (17.68 - 512 a) / (128 x 107.3) (prefill ignored).
CPU_FIXED = (17.68 - 14.94) / 256
CPU_PER_SEQ = (17.68 - 512 * CPU_FIXED) / (128 * 107.3)


def _cpu_preset() -> Inputs:
    readme = "benchmarks/README.md"
    sigma = fit_sigma(77, 107, 512)
    inp = inputs_from_measurements(
        name="realistic-cpu", prompts_per_step=16, group_size=8, prompt_tokens=40, max_response=512,
        decode_fixed_s=CPU_FIXED, decode_per_seq_s=CPU_PER_SEQ, prefill_tps=4000.0, update_s=17.1,
        update_tokens=128 * (40 + 107.3), sync_s=0.30, weight_bytes=21_765_376 * 4, total_devices=2,
        max_concurrency=128, length_median=77, length_sigma=sigma, length_min=20,
    )  # fmt: skip
    src = {
        "prompts_per_step": f"{readme} realistic shape: 16 prompts x n=8, up to 512 new tokens",
        "prompt_tokens": "assumed 40: the synthetic arithmetic prompts under e2e_vs_trl.py's 64-token limit",
        "lengths": f"lognormal, median 77, sigma {sigma:.3f} fitted to mean 107 at the 512 limit, at least 20 "
        f"({readme}: vLLM, 5 seeds, mean 105-109, median 76-80, ~20 to 512 tokens)",
        "decode": f"step = {CPU_FIXED * 1e3:.1f} ms + {CPU_PER_SEQ * 1e3:.3f} ms x b, fitted to {readme}'s partial "
        "run (17.68 s sync vs 14.94 s round_tokens=256, 107 tokens mean; see CPU_FIXED)",
        "prefill_tps": "assumed 4000 tokens/s (a 22M model's forward on 2 cores; only continuations depend on it)",
        "train_tps": f"update 17.1 s for 128 x (40 + 107.3) tokens ({readme}, partial-rollout run)",
        "old_logprob_tps": "inf: old_logprobs=engine, as the ours-vllm side runs",
        "weight_bytes": "21,765,376 fp32 parameters (docs/data.md, the small model)",
        "sync_gbps": f"0.30 s per sync ({readme}, ours-vllm); the same figure in place and between pools",
        "total_devices": "2: the trainer pool and the rollout pool of ../shared/reference/async-rollout-peers.md "
        "8.6 (simulated-latency engines, one raylet each)",
        "max_concurrency": f"128: the vLLM KV cache holds 128 sequences of 576 tokens ({readme})",
        "max_response": f"{readme} realistic shape",
        "rollout_tp": "1: one vLLM engine per pool",
        "colocated_sync_gbps": "as sync_gbps",
        "colocated_switch_s": "0: nothing is offloaded on CPU",
        "min_trainer_devices": "1: the small model trains on one device",
    }
    return dataclasses.replace(inp, sources=src)


PRESETS = {
    "qwen3-30b-a3b-atlas-2x8": lambda: _q30_preset("atlas"),
    "qwen3-30b-a3b-h20-2x8": lambda: _q30_preset("h20"),
    "realistic-cpu": _cpu_preset,
}


# ---------------------------------------------------------------------------------------------- CLI


def describe(inp: Inputs) -> list[str]:
    """Every input, its value and its source."""
    mean = statistics.fmean(inp.draw_lengths(np.random.default_rng(0), 20000).tolist())
    curve = ", ".join(
        f"{b:g}: {t:,.0f}"
        for b, t in zip(inp.decode_batch, inp.decode_tps, strict=True)
        if b in (1, 8, 32, 64, 128, 256)
    )
    rows = [
        ("prompts_per_step", f"B = {inp.prompts_per_step}, n = {inp.group_size}"),
        ("prompt_tokens", f"{inp.prompt_tokens:g}"),
        ("max_response", f"{inp.max_response}"),
        ("lengths", f"mean {mean:.0f} (20k draws)"),
        ("rollout_tp", f"{inp.rollout_tp} device(s) per replica"),
        ("decode", f"tokens/s per replica at concurrency {curve}"),
        ("prefill_tps", f"{inp.prefill_tps:,.0f} tokens/s per replica"),
        ("train_tps", f"{inp.train_tps:,.0f} tokens/s per device"),
        ("old_logprob_tps", f"{inp.old_logprob_tps:,.0f} tokens/s per device"),
        ("weight_bytes", f"{inp.weight_bytes / 1e9:.2f} GB"),
        ("sync_gbps", f"{inp.sync_gbps:.2f} GB/s: {inp.weight_bytes / inp.sync_gbps / 1e9:.1f} s per sync"),
        ("colocated_sync_gbps", f"{inp.colocated_sync_gbps:.2f} GB/s"),
        ("colocated_switch_s", f"{inp.colocated_switch_s:.1f} s"),
        ("max_concurrency", f"{inp.max_concurrency} colocated, {inp.max_concurrency_disagg} rollout-only"),
        ("min_trainer_devices", f"{inp.min_trainer_devices}"),
        ("total_devices", f"{inp.total_devices}"),
    ]
    return [f"  {k:<22} {v}\n  {'':<22} source: {inp.sources.get(k, '-')}" for k, v in rows]


def render(rows: list[Summary]) -> list[str]:
    base = {s.partial: s.step_s for s in rows if s.schedule == "colocated"}
    head = "| schedule | partial | rollout:trainer | gen (s) | train (s) | sync (s) | step (s) | vs colocated sync |"
    head += " trainer idle | rollout idle | rounds | replica imbalance |"
    out = [head, "|" + "---|" * 12]
    for s in rows:
        split = "all" if s.schedule == "colocated" else f"{s.rollout_devices}:{s.trainer_devices}"
        idle = ("-", "-") if s.schedule == "colocated" else (f"{s.trainer_idle:.2f}", f"{s.rollout_idle:.2f}")
        out.append(
            f"| {s.schedule} | {'yes' if s.partial else 'no'} | {split} | {s.gen_s:.1f} | {s.train_s:.1f} | "
            f"{s.sync_s:.1f} | {s.step_s:.1f} | {base[False] / s.step_s:.2f}x | {idle[0]} | {idle[1]} | "
            f"{s.rounds:.1f} | {s.replica_idle:.2f} |"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-30b-a3b-atlas-2x8")
    p.add_argument("--steps", type=int, default=60, help="simulated steps per schedule (the first 3 are warm-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--round-tokens", type=int, default=None, help="partial rollout's budget (default: half the limit)")
    a = p.parse_args(argv)
    inp = PRESETS[a.preset]()
    rt = a.round_tokens or inp.max_response // 2
    print(f"step-time model, preset {inp.name}: a model, not a measurement ({a.steps} steps, seed {a.seed})")
    print("inputs:")
    print("\n".join(describe(inp)))
    print(f"\npartial rollout: round_tokens {rt}, max_rounds {inp.max_rounds}, extra groups (max_rounds - 1) x B")
    rows = table(inp, a.steps, a.seed, rt)
    feasible = [s for s in rows if s.schedule == "colocated" or s.trainer_devices >= inp.min_trainer_devices]
    print("\n".join(render(feasible)))
    skipped = sorted({f"{s.rollout_devices}:{s.trainer_devices}" for s in rows if s not in feasible})
    if skipped:
        print(f"not shown: splits whose trainer pool is below {inp.min_trainer_devices} devices: {', '.join(skipped)}")
    rec = recommend_split(inp.with_partial(rt), steps=a.steps, seed=a.seed)
    print(
        f"\nrecommendation: one-step-off {rec.rollout_devices}:{rec.trainer_devices} (rollout:trainer), partial "
        f"rollout {'on' if rec.partial else 'off'}: {rec.step_s:.1f} s per step, {rec.speedup:.2f}x colocated "
        f"({rec.colocated_step_s:.1f} s, same partial setting); trainer idle {rec.trainer_idle:.2f}, rollout idle "
        f"{rec.rollout_idle:.2f}"
    )
    if inp.name == "realistic-cpu":  # the figures the decode step was fitted to: one device, colocated
        one = dataclasses.replace(inp, total_devices=1)
        got = [simulate(one.with_partial(r), "colocated", 1, 1, a.steps, a.seed).gen_s for r in (None, 256)]
        print(f"check, 1 device colocated: gen {got[0]:.2f} s sync (measured 17.68), {got[1]:.2f} s partial (14.94)")
    if rec.speedup < 1:
        print("colocated synchronous is faster than every feasible split here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
