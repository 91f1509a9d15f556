"""A process group for weight sync between the trainer pool and the rollout pool, outside both default worlds.

Each pool's processes have already called ``torch.distributed.init_process_group`` for their own world. Weight
sync needs one more group that spans the trainer's sender and the rollout ranks, and it must not touch either
default group, so it is built *stateless*: a ``TCPStore`` (rank 0 hosts it) under a ``PrefixStore``, a bare
``ProcessGroup`` and the comm backend's own class registered on it for its device type. Nothing is written to
torch.distributed's global registry (``_world``), so ``get_world_size()`` and every collective of the default
group are unchanged, and the two pools never need a common global rank numbering.

How it relates to upstream:

* vLLM 0.23's ``stateless_init_torch_distributed_process_group`` builds the same object (gloo in
  ``init_gloo_process_group``, nccl through ``Platform.stateless_init_device_torch_dist_pg``); it reaches the
  store through ``rendezvous(tcp://...)`` and uses vLLM's default timeout. vllm-ascend 0.23 dropped
  ``NPUPlatform.stateless_init_device_torch_dist_pg`` (0.11 had it) and builds its stateless HCCL group in
  ``model_loader/netloader/executor/netloader_pg.py:32-151`` (``stateless_init_process_group``). We build the
  ``TCPStore`` directly with the caller's timeout and construct each backend the way vLLM (gloo, nccl) and
  vllm-ascend 0.23's netloader (hccl: ``torch_npu._C._distributed_c10d.ProcessGroupHCCL`` with ``group_id`` the
  store prefix, ``global_ranks_in_group`` empty, and ``_set_default_backend``) do, except that netloader also
  enters the group in torch.distributed's registry (``_world``, ``_register_process_group``), which we leave out
  (above); tests/conformance/test_stateless_group_conformance.py holds all three constructions to the pinned
  wheels.
* verl's NPU weight sync instead builds vLLM's pure-Python ``StatelessProcessGroup`` (a TCPStore with
  pickled-object collectives) and vllm-ascend's ``PyHcclCommunicator`` on it (ctypes bindings of libhccl). That
  needs vLLM and vllm-ascend importable in the trainer process; a c10d ``ProcessGroup`` needs only torch /
  torch_npu, and the same code path serves gloo, nccl and hccl.

Collectives go through the group's own method (:func:`broadcast`), not ``torch.distributed.broadcast``: that
wrapper maps ``src`` (a *global* rank) through the registry, where this group is absent (checked with the CPU
lock's torch: ValueError "not initialized in the world group map"; vLLM's docstring says broadcast cannot be used
for the same reason). ``group_src=`` skips the mapping there, but the wrapper's registry-aware checks have changed
between torch releases; ``ProcessGroup.broadcast([t], BroadcastOptions)`` is the C++ entry point the wrapper itself
ends in, the same on torch 2.7 (NPU), 2.8 (GPU) and the CPU lock's torch. The backend is picked by the tensor's
device type, which is why each backend is registered for its device type.

Build it once per run and keep it: each HCCL / NCCL communicator holds device memory on every member (HCCL: 2 x
HCCL_BUFFSIZE, 200 MB by default, see doctor/planner.py) and driver resources, and rebuilding the sync group at
every weight sync exhausted them in other projects. :func:`destroy` releases it at the end of the run.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ..errors import DeviceError

_GROUP_NAME = "gspo_weight_sync"  # the group's name; its store keys and HCCL group_id are under "<tcp uri>/<name>/"


def stateless_process_group(
    comm_backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 600.0,
    device: Any = None,
):
    """A ``torch.distributed.ProcessGroup`` of ``world_size`` ranks over ``host:port``, outside the default world.

    ``comm_backend`` is the Backend's ``comm_backend`` ("gloo", "nccl", "hccl"). Rank 0 hosts the TCPStore at
    ``host:port``; every rank blocks here until all ``world_size`` ranks have joined (or ``timeout_s`` passes).
    nccl / hccl use the process's current device (the pool has set it). ``device`` matters for gloo only: a
    non-CPU device (e.g. cuda) whose tensors gloo should also carry, besides CPU tensors.
    """
    if comm_backend not in ("gloo", "nccl", "hccl"):
        raise ValueError(f"comm_backend must be gloo, nccl or hccl, not {comm_backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world_size {world_size}")
    from torch.distributed import PrefixStore, TCPStore

    timeout = timedelta(seconds=timeout_s)
    # world_size makes the server wait for every rank: the store doubles as the rendezvous
    store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
    # vllm-ascend 0.23 netloader_pg.py:97,106: the prefix is f"{init_method}/{group_name}/", init_method the tcp URI
    prefix = f"{_tcp_uri(host, port)}/{_GROUP_NAME}/"
    prefixed = PrefixStore(prefix, store)
    if comm_backend == "gloo":
        return _gloo_group(prefixed, rank, world_size, timeout, device)
    if comm_backend == "nccl":
        return _nccl_group(prefixed, rank, world_size, timeout)
    return _hccl_group(prefixed, rank, world_size, timeout, prefix, _GROUP_NAME)


def _tcp_uri(host: str, port: int) -> str:
    """``tcp://host:port``, an IPv6 host in brackets (vllm-ascend 0.23 netloader_pg.py:81-94 get_tcp_uri)."""
    import ipaddress

    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return f"tcp://{host}:{port}"
    return f"tcp://[{host}]:{port}"


def _gloo_group(store, rank: int, size: int, timeout: timedelta, device: Any = None):
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupGloo

    pg = ProcessGroup(store, rank, size)
    backend = ProcessGroupGloo(store, rank, size, timeout=timeout)  # its transport: the host's default interface
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, backend)
    if device is not None and torch.device(device).type != "cpu":  # e.g. cuda tensors, which gloo stages itself
        pg._register_backend(torch.device(torch.device(device).type), ProcessGroup.BackendType.GLOO, backend)
    return pg


def _nccl_group(store, rank: int, size: int, timeout: timedelta):
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import ProcessGroupNCCL

    pg = ProcessGroup(store, rank, size)
    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    backend = ProcessGroupNCCL(store, rank, size, options)
    pg._set_default_backend(ProcessGroup.BackendType.NCCL)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, backend)
    return pg


def _hccl_group(store, rank: int, size: int, timeout: timedelta, prefix: str, name: str):
    """Built as vllm-ascend 0.23 builds its stateless HCCL group (model_loader/netloader/executor/netloader_pg.py
    ``stateless_init_process_group``, held by the conformance test): ``_set_default_backend`` of hccl's backend type
    (:119), Options with ``is_high_priority_stream`` False, ``_timeout``, ``global_ranks_in_group`` [] and
    ``group_id`` the store prefix (:122-128), ProcessGroupHCCL(store, rank, size, options) (:130), registered for
    npu as a CUSTOM backend (:132-136), then the group's name and desc (:139-143). Its registry writes (:145-150)
    are left out: this group stays outside torch.distributed's registry (module docstring)."""
    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.distributed_c10d import Backend

    from . import detect

    npu, reason = detect.import_torch_npu()  # guarded: CANN may be missing or broken
    if npu is None:
        raise DeviceError(f"the hccl weight-sync group needs torch_npu: {reason}")
    try:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL
    except ImportError as exc:  # e.g. the CPU shim's torch_npu, which has no HCCL (it syncs with gloo)
        raise DeviceError(f"torch_npu has no ProcessGroupHCCL ({exc}); the hccl weight-sync group needs CANN") from exc

    pg = ProcessGroup(store, rank, size)
    pg._set_default_backend(Backend.backend_type_map[Backend("hccl")])  # CUSTOM: torch_npu registers hccl for npu
    options = ProcessGroupHCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    options.global_ranks_in_group = []
    options.group_id = prefix
    backend = ProcessGroupHCCL(store, rank, size, options)
    backend._set_sequence_number_for_group()
    pg._register_backend(torch.device("npu"), ProcessGroup.BackendType.CUSTOM, backend)
    pg._set_group_name(name)
    pg._set_group_desc("undefined")
    return pg


def broadcast(pg, tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` to every rank of ``pg``, and wait for it.

    ``tensor`` must be contiguous, with the same shape and dtype on every rank. The wait blocks the host on gloo;
    on nccl / hccl it orders the current stream after the collective, as ``torch.distributed.broadcast`` does.
    """
    from torch.distributed import BroadcastOptions

    if not tensor.is_contiguous():
        raise ValueError("broadcast needs a contiguous tensor: the collective writes into its storage")
    options = BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    pg.broadcast([tensor], options).wait()


def destroy(pg) -> None:
    """Release the group at the end of the run: ``ProcessGroup.shutdown()`` destroys the nccl / hccl
    communicators (a no-op for gloo); the TCPStore (and rank 0's server) goes when the last reference to ``pg``
    is dropped. The group was never registered with torch.distributed, so there is nothing to unregister."""
    pg.shutdown()


__all__ = ["broadcast", "destroy", "stateless_process_group"]
