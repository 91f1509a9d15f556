"""Ray workers: one actor per device, each holding the train engine and the rollout engine (colocated), or one of
them (a pool of a disaggregated run: pools.py).

Layout. ``trainer.nnodes x trainer.devices_per_node`` actors are placed with one placement group whose bundles
ask for one unit of the device contract's Ray resource (``GPU``, ``NPU``; CPU-only: CPUs) per actor, and a
pool's bundles one of its node share (placement.py ``pool_bundle``) where the nodes give it. Rank 0's
node address and a free port there form the ``torch.distributed`` rendezvous; the process group uses the
backend's collective (``gloo`` on CPU and under the NPU shim). Every actor runs both engines on its device:
training and rollout share devices, and after each optimizer phase the rollout weights are refreshed from the
trainer as a stream of ``(name, tensor)`` (:meth:`PolicyWorker.sync_weights`).

How we differ from verl: one worker class, no ``@register(dispatch_mode=...)`` decorators and no
``DataProto`` dispatch machinery. The driver-side :class:`WorkerGroup` splits a :class:`SampleBatch` into equal
contiguous data-parallel shards and concatenates the results; that is the whole dispatch protocol.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from .cluster import ClusterWatch, placement_line
from .config import Config, from_dict, to_dict
from .engines import Request, SampleBatch, SamplingParams
from .errors import UserError

# what a worker process must see of the driver's environment (device selection, the shim, torch_npu guard)
FORWARDED_ENV = (
    "GSPO_DEVICE",
    "GSPO_DEVICE_SHIM",
    "GSPO_SHIM_NPU_COUNT",
    "GSPO_HOME",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "GSPO_SIMULATED_ENGINES",  # simulated.py: tests and benchmarks only
)


def bind_cpu_cores() -> None:
    """The NPU profile's ``CPU_AFFINITY_CONF=1`` refined to this actor's NPU's share of the node's cores
    (npu_profile.actor_cpu_affinity, audit 3 finding 4); nothing outside a Ray actor."""
    import ray

    from .npu_profile import actor_cpu_affinity

    if not ray.is_initialized():
        return
    ctx = ray.get_runtime_context()
    node = ctx.get_node_id()
    npus = next((int(n["Resources"].get("NPU", 0)) for n in ray.nodes() if n["NodeID"] == node), 0)
    conf = actor_cpu_affinity(os.environ.get("CPU_AFFINITY_CONF"), ctx.get_accelerator_ids().get("NPU", []), npus,
                              os.sysconf("SC_NPROCESSORS_ONLN"))  # fmt: skip
    if conf is not None:
        os.environ["CPU_AFFINITY_CONF"] = conf


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class PolicyWorker:
    """The body of one Ray actor (also usable in-process, which the tests of the engines do)."""

    def __init__(self, cfg_dict: dict, model_path: str, rank: int, world_size: int, threads: int):
        self.cfg: Config = from_dict(cfg_dict)
        self.model_path, self.rank, self.world_size = model_path, rank, world_size
        self.threads = threads
        self.train_engine: Any = None
        self.rollout_engine: Any = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def node(self) -> tuple[str, str]:
        from .cluster import this_node

        return this_node()

    def setup(self, master_addr: str, master_port: int, train: bool = True, rollout: bool = True) -> None:
        import torch
        from transformers.utils import logging as hf_logging

        from . import simulated
        from .device import get_backend
        from .engines import build_rollout_engine, build_train_engine

        torch.set_num_threads(self.threads)  # Ray does not pin threads; 2 workers on 2 cores must not fight
        hf_logging.disable_progress_bar()  # per-worker "Loading weights" bars would bury the step line
        if self.cfg.trainer.device == "npu":
            bind_cpu_cores()  # before set_device starts torch_npu's threads, which read CPU_AFFINITY_CONF
        backend = get_backend(self.cfg.trainer.device)
        backend.set_device(0)  # Ray makes exactly the bundle's device visible to this process
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK="0")
        torch.distributed.init_process_group(backend.comm_backend, rank=self.rank, world_size=self.world_size)
        backend.manual_seed(self.cfg.trainer.seed)
        self.backend = backend
        # train=False: rollout only (`gspo-ascend eval`, a rollout pool), no optimizer state held for nothing;
        # rollout=False: a trainer pool, no KV cache
        self.train_engine = build_train_engine(self.cfg, backend, self.model_path) if train else None
        self.rollout_engine = build_rollout_engine(self.cfg, backend, self.model_path) if rollout else None
        # GSPO_SIMULATED_ENGINES (tests and benchmarks only): the engines' time modelled, slept through
        self.train_engine, self.rollout_engine = simulated.wrap(self.train_engine, self.rollout_engine)
        if self.cfg.rollout.weights_lag and train and rollout:
            self.start_history()

    # -- the sync group between pools (disaggregated rollout; weight_sync.py) -------------------------------

    def join_sync(self, addr: str, port: int, rank: int, world_size: int) -> None:
        from .device.stateless_group import stateless_process_group

        self.sync_rank = rank
        self.sync_group = stateless_process_group(self.backend.comm_backend, addr, port, rank, world_size)

    def send_weights(self, bucket_bytes: int, version: int) -> dict[str, float]:
        """Trainer pool: every rank exports (a collective of the trainer world); rank 0 of the sync group sends."""
        from .weight_sync import send

        group = self.sync_group if getattr(self, "sync_rank", None) == 0 else None
        return send(group, self.train_engine.export_weights(), bucket_bytes, version, self._sync_device())

    def receive_weights(self) -> dict[str, float]:
        """Rollout pool: the buckets, as they arrive, into the engine's ordinary ``update_weights``."""
        from .weight_sync import Receiver

        start = time.perf_counter()
        received = Receiver(self.sync_group, self._sync_device())
        loaded = self.rollout_engine.update_weights(received)  # what the colocated sync reports as sync/bytes
        self._rest()
        return {"sync/bytes": float(loaded), "sync/wire_bytes": float(received.bytes),
                "sync/load_s": time.perf_counter() - start,
                "sync/version": float(received.version if received.version is not None else -1)}  # fmt: skip

    def weight_digests(self) -> dict[str, str]:
        """sha256 of every weight's bytes by HF name: the trainer's export (a collective: every trainer rank calls
        it), or what this rank's hf rollout engine holds. The check that a sync delivered the export bitwise."""
        import hashlib

        from .weight_sync import raw_bytes

        named = self.train_engine.export_weights() if self.train_engine is not None else self.rollout_engine.weights()
        return {name: hashlib.sha256(raw_bytes(t).cpu().numpy().tobytes()).hexdigest() for name, t in named}

    def _sync_device(self) -> Any:
        """Where buckets live: host memory for gloo, the device for the device collectives (NCCL / HCCL)."""
        import torch

        return torch.device("cpu") if self.backend.comm_backend == "gloo" else self.backend.device(0)

    # -- the phases of a step ------------------------------------------------------------------------------

    def _rest(self) -> None:
        """After a rollout phase: the rollout engine sleeps (weights to host memory, KV cache freed) only where the
        train engine needs the room. A rollout pool's devices (and `eval`'s) hold vLLM alone: sleeping there would
        copy the weights off and back for every call (audit 3 finding 8: ~28 GiB each way at TP 2)."""
        if self.train_engine is not None:
            self.rollout_engine.sleep()

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> SampleBatch:
        self.rollout_engine.wake_up()
        batch = self.rollout_engine.generate(prompts, params)
        self._rest()
        return batch

    def generate_requests(self, requests: list[Request], params: SamplingParams) -> SampleBatch:
        self.rollout_engine.wake_up()
        batch = self.rollout_engine.generate_requests(requests, params)
        self._rest()
        return batch

    def generate_trajectories(
        self, prompts: list[list[int]], params: SamplingParams, rows: list, first: int, step: int
    ) -> tuple[SampleBatch, dict[str, float], list]:
        """Multi-turn rollout of a slice of the step's prompts (``first``: its place in the draw) with every
        trajectory in flight on this rank's vLLM engine (AgentLoop.in_flight), the tools in this worker's own
        tool processes. Returns the batch, the agent and tool metrics, and the tool faults' first lines (the driver
        says each once)."""
        from .agent_loop import AgentLoop
        from .runtime import load_tokenizer
        from .tools.toolbox import ToolBox

        if getattr(self, "_agent", None) is None:  # the tool processes start at the first call, stop with the actor
            box = ToolBox.from_config(self.cfg.tools, stream=[])
            self._agent = AgentLoop.of(box, load_tokenizer(self.cfg, self.model_path), self.cfg.tools)
        loop, box = self._agent, self._agent.toolbox
        self.rollout_engine.wake_up()
        try:
            stepper = self.rollout_engine.in_flight(params)
            batch, metrics = loop.in_flight(prompts, params, stepper, step=step, rows=rows, first=first)
        finally:
            self._rest()
        return batch, metrics | box.metrics(), box.take_lines()

    def compute_log_probs(self, batch: SampleBatch, temperature: float):
        return self.train_engine.compute_log_probs(batch, temperature)

    def update(self, batch: SampleBatch, temperature: float) -> dict[str, float]:
        return self.train_engine.update(batch, temperature)

    def sync_weights(self) -> dict[str, float]:
        """Train engine -> rollout engine, one tensor at a time (peak extra memory: the largest tensor). verl's
        order: the rollout engine wakes only its weights (``update_weights`` does), the train engine brings up only
        its parameters for the export (not its gradients or optimizer state) and parks them again, and only then
        is the KV cache mapped (``sleep``, which puts the whole engine back to sleep). Waking everything first put
        the trainer's state, the rollout weights and the KV cache on the device at once: 64.6 GiB for the 30B
        layout on a 64 GiB 910B (issue #25)."""
        start = time.perf_counter()
        weights = self.train_engine.export_weights()
        if getattr(self, "_history", None) is not None:  # rollout.weights_lag: the weights of `lag` updates ago
            weights = self._lagged(weights)
        sent = self.rollout_engine.update_weights(weights)
        self.rollout_engine.sleep()
        metrics = {"sync/bytes": float(sent), "sync/time_s": time.perf_counter() - start}
        host = getattr(self.rollout_engine, "last_sync", {}).get("host_bytes")  # the vllm engine counts them
        if host is not None:  # what went through host memory as serialised bytes (audit 3 finding 5)
            metrics["sync/host_bytes"] = float(host)
        return metrics

    def start_history(self) -> None:
        """``rollout.weights_lag``: version 0, the weights before any update (the export is a collective)."""
        from collections import deque

        self._history = deque(maxlen=self.cfg.rollout.weights_lag + 1)  # the oldest drops out as the newest comes
        self._lagged(self.train_engine.export_weights())

    def _lagged(self, weights) -> list:
        """``rollout.weights_lag`` (staleness studies): host copies of the last lag + 1 versions, the initial one
        first (taken at set-up); the oldest is what the rollout engine holds."""
        self._history.append([(name, t.detach().to("cpu", copy=True)) for name, t in weights])
        return self._history[0]

    def show_weights(self, which: str) -> None:
        """``rollout.weights_lag``: validation measures the current weights ("current"), then the rollout engine
        goes back to the lagged ones ("lagged")."""
        named = self.train_engine.export_weights() if which == "current" else self._history[0]
        self.rollout_engine.update_weights(named)
        self.rollout_engine.sleep()

    def save_checkpoint(self, path: str) -> None:
        self.train_engine.save_checkpoint(path)

    def load_checkpoint(self, path: str) -> None:
        self.train_engine.load_checkpoint(path)

    def save_hf(self, path: str) -> None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_path or self.model_path)
        self.train_engine.save_hf(path, tokenizer)

    def shutdown(self) -> None:
        import torch

        if getattr(self, "_agent", None) is not None:  # multi-turn rollout's tool processes
            self._agent.toolbox.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def actor_env(cfg: Config, backend) -> dict[str, str]:
    """Environment each actor process must start with: variables torch_npu reads once, at its start, which
    happens in :meth:`PolicyWorker.setup` (``get_backend``) before any engine is built
    (:func:`~gspo_ascend.engines.vllm_env.process_start_env`). A value exported on the driver wins. With MindSpeed
    (megatron on NPU), the Megatron-LM checkout the driver imports ``megatron.training`` from (megatron_lm.py)."""
    from .engines.vllm_env import process_start_env

    env = {key: os.environ.get(key, value) for key, value in process_start_env(cfg, backend).items()}
    if cfg.actor.engine == "megatron" and cfg.trainer.device == "npu":
        from .megatron_lm import training_root

        # MindSpeed 26.1.0 imports Megatron-LM's megatron.training: its checkout on every actor's path, not only
        # in the shell that ran the install (Ray puts runtime_env's PYTHONPATH before the node's own)
        root = training_root()
        if root is not None:
            env["PYTHONPATH"] = os.pathsep.join(
                [root, *([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])]
            )
    return env


def _init_ray(backend, world_size: int) -> None:
    import ray

    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`, or a user-started cluster: join it
        ray.init(log_to_driver=True)
        return
    resources = {backend.ray_resource: world_size} if backend.emulated and backend.ray_resource else None
    # Ray starts workers at niceness 15; on a shared host they would lose the CPU to anything else running
    os.environ.setdefault("RAY_worker_niceness", "0")
    # and prestarts idle Python workers for the first driver, which our actors (their own resources and runtime
    # env) mostly leave idle: a tiny CPU run spent 22.4-23.1 CPU-s with them, 19.9-21.0 without (2026-12-02, 2 cores)
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    os.environ.setdefault("RAY_enable_worker_prestart", "0")
    env = {k: os.environ[k] for k in FORWARDED_ENV if k in os.environ}
    ray.init(
        num_cpus=max(os.cpu_count() or 1, world_size),
        resources=resources,  # the NPU shim: pretend the resource exists so placement logic is exercised
        include_dashboard=False,
        runtime_env={"env_vars": env},
        log_to_driver=True,
    )


_SAID: set[str] = set()  # the driver's placement notes already printed


def actor_resources(bundle: dict[str, float]) -> dict[str, Any]:
    """Ray actor options asking for one placement bundle. CPU and GPU are Ray's own resources, which it accepts only
    as ``num_cpus`` / ``num_gpus`` (in ``resources`` it raises "Use the 'num_cpus' and 'num_gpus' keyword instead");
    any other (NPU) is a custom resource. Found by the first run on a GPU (docs/results/gpu/)."""
    return {
        "num_cpus": bundle.get("CPU", 0),
        "num_gpus": bundle.get("GPU", 0),
        "resources": {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")},
    }


class WorkerGroup:
    """Driver-side handle on the ``world_size`` actors; methods mirror :class:`PolicyWorker`'s phases."""

    def __init__(
        self,
        cfg: Config,
        backend,
        model_path: str,
        *,
        train: bool = True,
        rollout: bool = True,
        actors: int = 0,
        pool: str | None = None,
    ):
        """``cfg.trainer.nnodes x devices_per_node`` actors with the engines asked for (a pool of a disaggregated
        run gets a config whose trainer layout is its own: pools.py); ``actors``: all the run's actors, when
        other pools share the machines (0 = these alone), so CPU threads are split among all of them; ``pool``:
        which pool of a disaggregated run this is ("trainer", "rollout"; None: none, as `gspo-ascend eval`)."""
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from .placement import check_node_local, pool_bundle, rank_bundles

        self.cfg = cfg
        self.world_size = cfg.trainer.nnodes * cfg.trainer.devices_per_node
        actors = max(actors, self.world_size)
        _init_ray(backend, actors)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        on_cpu = backend.ray_resource is None or backend.emulated
        if cfg.trainer.cpu_threads and not on_cpu:
            raise UserError(
                f"config key 'trainer.cpu_threads' sets CPU threads for CPU devices; this run is on {backend.name}: "
                "remove it (or set 0)"
            )
        threads = (cfg.trainer.cpu_threads or max(1, cpus // actors)) if on_cpu else 1
        bundle = {"CPU": threads} if backend.ray_resource is None else {"CPU": 1, backend.ray_resource: 1}
        # a pool of a disaggregated run asks for its node's share of that pool (placement.py, scripts/lib/ray.sh)
        if pool is not None:
            alive = sum(1 for n in ray.nodes() if n.get("Alive"))
            bundle, note = pool_bundle(bundle, pool, ray.cluster_resources(), self.world_size, alive)
            if note and note not in _SAID:  # both pools find the same cluster: one line
                _SAID.add(note)
                print(note, file=sys.stderr, flush=True)
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        if not _wait_ready(self.pg, timeout_s=120):
            raise UserError(
                f"Ray could not place {self.world_size} workers with {bundle} each (cluster has "
                f"{ray.cluster_resources()}); check trainer.nnodes x trainer.devices_per_node"
            )
        remote = ray.remote(PolicyWorker)
        cfg_dict = to_dict(cfg)
        env = actor_env(cfg, backend)  # Ray merges these into the job's env_vars, set before the process starts
        # PACK does not order bundles by node: number the ranks node by node, so that the TP / EP / rollout-TP
        # groups (blocks of nearby ranks) stay within a node (gspo_ascend/placement.py)
        bundle_of_rank = rank_bundles(placement_group_table(self.pg).get("bundles_to_node_id", {}), self.world_size)
        self.workers = [
            remote.options(
                **actor_resources(bundle),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=index),
                **({"runtime_env": {"env_vars": env}} if env else {}),
            ).remote(cfg_dict, model_path, rank, self.world_size, threads)
            for rank, index in enumerate(bundle_of_rank)
        ]
        # fail-fast gathering: a lost rank or node is one line (ClusterError), not a wait on the survivors
        self.watch = ClusterWatch(self.workers, [], cfg.trainer.output_dir)
        self.watch.nodes = self._get([w.node.remote() for w in self.workers])
        # where each rank runs, once; on stderr, because `gspo-ascend eval` prints its table on stdout
        print(placement_line(self.watch.nodes), file=sys.stderr, flush=True)
        try:  # where the actors really run: a node's share of ranks that a group size does not divide is one line
            check_node_local(cfg, self.watch.nodes, train, rollout)  # a trainer pool holds no rollout TP group
        except UserError:
            self.watch.broken = True  # nothing set up yet: kill the actors and free the bundles, then say why
            self.shutdown()
            raise
        addr, port = self._get([self.workers[0].address.remote()])[0]
        self._all("setup", addr, port, train, rollout)

    def _get(self, refs: list) -> list:
        return self.watch.get(refs)

    def _all(self, method: str, *args: Any) -> list:
        return self._get([getattr(w, method).remote(*args) for w in self.workers])

    def _sharded(self, method: str, batch: SampleBatch, *args: Any) -> list:
        shards = batch.split(self.world_size)
        return self._get([getattr(w, method).remote(s, *args) for w, s in zip(self.workers, shards, strict=True)])

    def _rollout_tp(self) -> int:
        """Ranks per rollout group: rollout.tensor_parallel_size with vLLM, 1 with hf (no rollout TP)."""
        return self.cfg.rollout.tensor_parallel_size if self.cfg.rollout.engine == "vllm" else 1

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> SampleBatch:
        """Each rollout tensor-parallel group of ranks (1 rank unless rollout.engine=vllm with TP > 1) gets a
        contiguous slice of the prompts and its own seed; the group's first rank's samples are kept."""
        return self.submit(prompts, params).result()

    def submit(self, prompts: list[list[int]], params: SamplingParams) -> Pending:
        """:meth:`generate`, started and not waited for (one-step-off: the next batch generates while the trainer
        pool trains on this one)."""
        from .engines.rollout_shards import gather_rollout_shards, split_rollout_prompts

        tp = self._rollout_tp()
        parts = split_rollout_prompts(prompts, params, self.world_size, tp)
        refs = [w.generate.remote(p, sp) for w, (p, sp) in zip(self.workers, parts, strict=True)]
        return Pending(lambda: gather_rollout_shards(self._get(refs), tp))

    def generate_requests(self, requests: list[Request], params: SamplingParams) -> SampleBatch:
        """Requests with their own budgets and seeds (partial_rollout.py), cut into one contiguous run per rollout
        group with about equal samples each; every rank of a group gets its group's run. Samples keep request
        order and ``group_index`` is the request's position in ``requests``."""
        from .engines.rollout_shards import rollout_tp_groups

        tp = self._rollout_tp()
        groups = rollout_tp_groups(self.world_size, tp)
        runs = balanced_runs([q.n for q in requests], len(groups))
        calls = [
            self.workers[r].generate_requests.remote(requests[a:b], params)
            for (a, b), ranks in zip(runs, groups, strict=True)
            for r in ranks
        ]
        done = self._get(calls)
        parts = [done[g * tp].replace(group_index=done[g * tp].group_index + a) for g, (a, _) in enumerate(runs)]
        return SampleBatch.concat(parts)

    def generate_trajectories(
        self, prompts: list[list[int]], params: SamplingParams, rows: list, step: int
    ) -> tuple[SampleBatch, dict[str, float], list]:
        """Multi-turn rollout in flight (:meth:`PolicyWorker.generate_trajectories`): each rank (rollout TP 1) runs a
        contiguous run of the prompts with about equal trajectories; a trajectory's seeds follow its place in the
        draw, so the samples do not depend on the layout. Metrics: tool counts summed, ``agent/*`` means over
        every trajectory."""
        runs = balanced_runs([params.n] * len(prompts), self.world_size)
        done = self._get([
            w.generate_trajectories.remote(prompts[a:b], params, rows[a:b], a, step)
            for w, (a, b) in zip(self.workers, runs, strict=True)
        ])  # fmt: skip
        parts = [b.replace(group_index=b.group_index + a) for (b, _, _), (a, _) in zip(done, runs, strict=True)]
        batch = SampleBatch.concat(parts)
        metrics: dict[str, float] = {}
        for part, got, _ in done:
            for key, value in got.items():  # agent/* are means over a part's trajectories: weigh by its size
                metrics[key] = metrics.get(key, 0.0) + (value * len(part) / len(batch) if key.startswith("agent/")
                                                        else value)  # fmt: skip
        return batch, metrics, [line for _, _, lines in done for line in lines]

    def generate_each(
        self, requests: list[tuple[list[list[int]], SamplingParams]], on_done: Callable[[int], None] | None = None
    ) -> list[SampleBatch]:
        """Independent requests (validation chunks, each with its own seed), spread over the rollout groups in
        rounds; one batch per request, in order; ``on_done(requests finished)`` after each round. A request's
        samples do not depend on which group ran it, so the result is that of one engine running the requests one
        after another (what `gspo-ascend eval` does on one device)."""

        from .engines.rollout_shards import rollout_tp_groups

        tp = self._rollout_tp()
        groups = rollout_tp_groups(self.world_size, tp)
        out: list[SampleBatch] = []
        for start in range(0, len(requests), len(groups)):
            batch = requests[start : start + len(groups)]
            # every group works in every round, as in a training rollout (a short last round repeats its final
            # request and drops the result): no rollout group is ever asked to sit out a step
            padded = batch + [batch[-1]] * (len(groups) - len(batch))
            pairs = zip(padded, groups, strict=True)
            done = self._get([self.workers[r].generate.remote(*q) for q, ranks in pairs for r in ranks])
            out.extend(done[g * tp] for g in range(len(batch)))  # a group's first rank; the others hold the same
            if on_done is not None:
                on_done(len(out))
        return out

    def compute_log_probs(self, batch: SampleBatch, temperature: float):
        """Each rank scores the samples its ``update`` will train (:meth:`update`'s shards): the old-log-prob
        forward's MoE routes, which routing replay r2 replays, stay on the rank that recorded them. A batch that
        does not cut into the minibatches (none the trainer sends) is split evenly."""
        import torch

        from .engines.microbatch import dp_rows

        k = self.cfg.algorithm.minibatches_per_rollout
        if not k or len(batch) % (k * self.world_size):
            return torch.cat(self._sharded("compute_log_probs", batch, temperature), 0)
        rows = dp_rows(len(batch), self.world_size, k)
        pairs = zip(self.workers, rows, strict=True)
        got = self._get([w.compute_log_probs.remote(batch.select(r), temperature) for w, r in pairs])
        out = torch.empty((len(batch), *got[0].shape[1:]), dtype=got[0].dtype)
        for r, lp in zip(rows, got, strict=True):
            out[r] = lp
        return out

    def update(self, batch: SampleBatch, temperature: float, minibatches: int) -> dict[str, float]:
        """Rank r gets the r-th part of every minibatch, so minibatch j is the same set of samples at any
        data-parallel size (DP=2 trains exactly like DP=1 on the same batch)."""
        from .engines.microbatch import dp_rows

        shards = [batch.select(r) for r in dp_rows(len(batch), self.world_size, minibatches)]
        per_rank = self._get([w.update.remote(s, temperature) for w, s in zip(self.workers, shards, strict=True)])
        return {k: sum(m[k] for m in per_rank) / len(per_rank) for k in per_rank[0]}

    def show_weights(self, which: str) -> None:
        self._all("show_weights", which)

    def sync_weights(self) -> dict[str, float]:
        per_rank = self._all("sync_weights")
        metrics = {"sync/bytes": per_rank[0]["sync/bytes"], "sync/time_s": max(m["sync/time_s"] for m in per_rank)}
        if "sync/host_bytes" in per_rank[0]:
            metrics["sync/host_bytes"] = per_rank[0]["sync/host_bytes"]
        return metrics

    def save_checkpoint(self, path: str) -> None:
        self._all("save_checkpoint", path)

    def load_checkpoint(self, path: str) -> None:
        self._all("load_checkpoint", path)

    def save_hf(self, path: str) -> None:
        self._all("save_hf", path)

    def shutdown(self) -> None:
        """Close the process groups, then kill the actors. After a lost rank (or any failure mid-call, when a rank
        may be stuck in a collective) the graceful part is bounded: a shutdown queued behind a call that never
        returns would otherwise hang the driver."""
        import ray
        from ray.util.placement_group import remove_placement_group

        try:
            if not self.watch.broken:
                ray.wait([w.shutdown.remote() for w in self.workers], num_returns=len(self.workers), timeout=60)
        finally:
            for w in self.workers:
                ray.kill(w)
            remove_placement_group(self.pg)


class Pending:
    """A rollout in flight: :meth:`result` waits for it (through the cluster watch: a lost rank is one line)."""

    def __init__(self, wait: Callable[[], SampleBatch]) -> None:
        self._wait, self._batch = wait, None

    def result(self) -> SampleBatch:
        if self._batch is None:
            self._batch = self._wait()
        return self._batch


def balanced_runs(sizes: list[int], parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous index ranges ``[a, b)`` of ``sizes``, cut where the running sum is nearest to each
    ``g / parts`` of the total (the first such cut on a tie), so the runs hold about equal samples."""
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    bounds = [0]
    for g in range(1, parts):
        target = prefix[-1] * g / parts
        bounds.append(min(range(bounds[-1], len(prefix)), key=lambda k: abs(prefix[k] - target)))
    bounds.append(len(sizes))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _wait_ready(pg, timeout_s: float) -> bool:
    import ray

    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    return bool(ready)
