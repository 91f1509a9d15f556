"""CUDA-API -> CPU redirection, so that unmodified megatron-core trains on a CPU over gloo.

megatron-core is written for CUDA: it allocates with ``device=torch.cuda.current_device()``, forks the CUDA
RNG for tensor-parallel initialisation, dropout and recomputation, creates streams and events, and checks
that parameters are ``torch.cuda.FloatTensor``. :func:`install_cuda_redirect` makes each of those call sites
work on a CPU build of torch by monkeypatching torch attributes (never megatron's files), and
:func:`uninstall_cuda_redirect` puts every original back. Install it *before* importing megatron.core, which
binds some ``torch.cuda`` names at import time.

The emulated world: there is one "CUDA device", index 0, and it *is* the CPU.

* Device arguments naming CUDA (``"cuda"``, ``"cuda:N"``, ``torch.device("cuda")``, a bare index such as
  ``torch.cuda.current_device()``) are rewritten to ``"cpu"`` in torch's tensor factories, ``Tensor.new_*``
  and ``Tensor.to``; ``Tensor.cuda()`` (hence ``Module.cuda()``) returns the tensor itself; ``Tensor.type()``
  reports ``torch.cuda.*Tensor`` names, which is what a tensor allocated on "cuda" is called.
  (Not a ``TorchFunctionMode``: a mode is popped while a Python-level torch function such as
  ``torch.autograd.backward`` runs, so megatron's custom backward functions, which allocate on "cuda",
  would escape it.)
* The CUDA generator *is* the CPU default generator, so megatron's RNG tracker really saves, swaps and
  restores the state CPU random ops consume. A no-op stand-in would let tensor-parallel ranks that must
  initialise replicated weights identically drift apart.
* Streams and events are synchronous stand-ins; ``synchronize()`` has nothing to wait for.
* One gap that only shows without CUDA: tensor split sizes for ``all_to_all_single``. (The other, the
  ``te_general_gemm`` name ``moe_utils`` lacks without Transformer Engine, is not the CPU's: CUDA without TE
  meets it too, so the product fixes it, ``engines/megatron_compat.py``, and CI runs that fix.)
* ``pin_memory=True`` in a factory is ignored: pinned host memory only speeds up host <-> device copies, and here
  the host memory is the device memory (a torch without an accelerator refuses to pin at all).

Deliberately left alone: ``is_available()`` / ``device_count()`` keep answering False / 0 (libraries that
probe for CUDA are not misled, and megatron-core's training path does not ask), ``Tensor.is_cuda`` and
``tensor.device`` stay honest, and the ``torch.cuda.memory_*`` statistics already return zeros on a CPU
build. Each patch below names the megatron call site that needs it.

How this differs from torch_npu's ``transfer_to_npu``: that module runs on real accelerator hardware and
rewrites CUDA calls to their *NPU* equivalents (``torch.cuda.*`` -> ``torch.npu.*``, ``"cuda"`` -> ``"npu"``,
nccl -> hccl), keeping asynchronous streams, device memory and device RNGs. Here there is no device:
everything maps to the CPU, streams are synchronous, the generator is the CPU's, and the process group is
gloo (chosen by the caller). The purpose is executing megatron's real code paths in CI, not speed.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed

# (object, attribute name, original value or _MISSING), in installation order; uninstall walks it backwards.
_MISSING = object()
_patched: list[tuple[Any, str, Any]] = []
_installed = False
_log_filter: logging.Filter | None = None
_script_aliases: list[Callable] = []


def _patch(owner: Any, name: str, value: Any) -> None:
    """Set ``owner.name = value``, remembering the exact previous state (own attribute or absent)."""
    _patched.append((owner, name, vars(owner).get(name, _MISSING)))
    setattr(owner, name, value)


# --- device mapping -------------------------------------------------------------------------------------


# Device-type names given as strings that the factories map to "cpu". "cuda" always; the MindSpeed support adds
# "npu" (MindSpeed allocates with device="npu" by name; see mindspeed_support.py).
_REDIRECTED_NAMES = {"cuda"}


def redirect_device_name(name: str, on: bool = True) -> None:
    """Also map (``on``) or stop mapping device strings ``name`` / ``name:N`` to "cpu" ("cuda" always stays)."""
    if on:
        _REDIRECTED_NAMES.add(name)
    elif name != "cuda":
        _REDIRECTED_NAMES.discard(name)


def _cpu_if_cuda(device: Any) -> Any:
    """Map a CUDA device designation (str, torch.device or bare index) to "cpu"; leave anything else."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"  # torch.cuda.current_device() ints: megatron's usual device argument
    if isinstance(device, str) and device.split(":")[0] in _REDIRECTED_NAMES:
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return "cpu"
    return device


# The dense tensor factories that take ``device=`` (torch.utils._device's constructor list without the
# window / fft / sparse / nested / quantized ones, plus the *_like ones). megatron passes
# device=torch.cuda.current_device() to torch.empty/zeros/ones/arange/tensor/full/randn/... throughout
# (DDP buffers, pipeline p2p shapes, MoE token counts, optimizer scalars).
_TORCH_FACTORIES = (
    "empty", "empty_strided", "empty_permuted", "zeros", "ones", "full", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "tensor", "as_tensor", "asarray",
    "scalar_tensor", "tril_indices", "triu_indices", "empty_like", "zeros_like", "ones_like", "full_like",
    "rand_like", "randn_like", "randint_like",
)  # fmt: skip
# Tensor.new_* allocate on ``device=`` when given (tensor_parallel/mappings.py: _AllToAll, gather/scatter).
_TENSOR_FACTORIES = ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "new_tensor")


# ``pin_memory=True`` in a factory is a no-op here. Pinned (page-locked) host memory only speeds up host <-> device
# copies; on the emulated device the host memory *is* the device memory, so there is no copy to speed up, while a
# torch without a usable accelerator refuses to pin at all (torch 2.7.1's CUDA wheel on a CPU box: "Found no NVIDIA
# driver on your system"). Call sites:
# the CP index tensors of megatron's and MindSpeed's ``get_pos_emb_on_this_cp_rank``
# (``torch.tensor([...], device="cpu", pin_memory=True).cuda(non_blocking=True)``). Values, dtype and device of
# the tensor are unchanged; ``is_pinned()`` reports False.
def _with_cpu_device(factory: Callable) -> Callable:
    @functools.wraps(factory)
    def redirected(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False  # pinning is meaningless on the emulated device (above)
        return factory(*args, **kwargs)

    return redirected


def _tensor_to(original: Callable) -> Callable:
    """Tensor.to(device, ...) / to(device=...): rotary_pos_embedding and moe/router move buffers and weights
    with ``.to(device=torch.cuda.current_device())``; nn.Module.to / .cuda() end up here too."""

    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args:  # positional device; a dtype or a tensor passes through _cpu_if_cuda unchanged
            args = (_cpu_if_cuda(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return original(self, *args, **kwargs)

    return to


def _tensor_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **_: Any) -> torch.Tensor:
    """Tensor.cuda() (and so nn.Module.cuda()): the tensor already lives on the emulated device, and .cuda()
    of a resident tensor returns the tensor itself."""
    return self


def _tensor_type(original: Callable) -> Callable:
    """Tensor.type(): optimizer.py / distrib_optimizer.py sort parameters by comparing it with
    'torch.cuda.FloatTensor' / 'torch.cuda.HalfTensor' (and clip_grads asserts it), so a tensor allocated on
    "cuda" reports the CUDA name; a cast to a CUDA type name casts to the matching CPU type."""

    @functools.wraps(original)
    def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None:  # under a TorchFunctionMode, original(self) reaches the mode as this wrapper: once only
            name = original(self)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if isinstance(dtype, str):
            dtype = dtype.replace("torch.cuda.", "torch.", 1)
        return original(self, dtype, non_blocking, **kwargs)

    return tensor_type


def _script_as_original(wrapper: Callable, original: Callable) -> None:
    """TorchScript compiles a call to torch.zeros & co. by looking the function object up in its builtin
    table; a Python wrapper is not there, so ``@torch.jit.script`` code (in any library imported after
    install) would fail. Register each wrapper as an alias of the original's aten op."""
    table = torch.jit._builtins._get_builtin_table()
    if id(original) in table:
        table[id(wrapper)] = table[id(original)]
        _script_aliases.append(wrapper)  # keeps the id alive while it is in the table


def _install_device_mapping() -> None:
    for name in _TORCH_FACTORIES:
        original = getattr(torch, name)
        _patch(torch, name, _with_cpu_device(original))
        _script_as_original(getattr(torch, name), original)
    for name in _TENSOR_FACTORIES:
        _patch(torch.Tensor, name, _with_cpu_device(getattr(torch.Tensor, name)))
    _patch(torch.Tensor, "to", _tensor_to(torch.Tensor.to))
    _patch(torch.Tensor, "cuda", _tensor_cuda)
    _patch(torch.Tensor, "type", _tensor_type(torch.Tensor.type))


# --- torch.cuda stand-ins -------------------------------------------------------------------------------


class _Event:
    """torch.cuda.Event on a synchronous device: recorded work is already complete; timing is wall clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False, **_):
        self._time: float | None = None

    def record(self, stream: Any = None) -> None:
        self._time = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: _Event) -> float:
        return (end_event._time - self._time) * 1000.0  # milliseconds, as CUDA events report


class _Stream:
    """torch.cuda.Stream on a synchronous device: every wait is already satisfied."""

    def __init__(self, device: Any = None, priority: int = 0, **_):
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: _Event | None = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_STREAM = _Stream()


class _StreamContext:
    """``with torch.cuda.stream(s):`` -- nothing to switch on a synchronous device."""

    def __init__(self, stream: Any = None):
        self.stream = stream

    def __enter__(self) -> Any:
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        return None


def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _get_rng_state_all() -> list[torch.Tensor]:
    return [_get_rng_state()]


def _set_rng_state_all(new_states: Any) -> None:
    for state in new_states:
        _set_rng_state(state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _seed() -> None:
    torch.default_generator.seed()


def _initial_seed() -> int:
    return torch.default_generator.initial_seed()


_RNG_FUNCTIONS: dict[str, Callable] = {
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "get_rng_state_all": _get_rng_state_all,
    "set_rng_state_all": _set_rng_state_all,
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": _seed,
    "seed_all": _seed,
    "initial_seed": _initial_seed,
}


def _install_rng() -> None:
    """One CUDA generator, and it is the CPU default generator (the one CPU random ops draw from).

    tensor_parallel/random.py: CudaRNGStatesTracker.add/fork call torch.cuda.get_rng_state,
    torch.cuda.random.get_rng_state and torch.cuda.manual_seed, and _set_cuda_rng_state sets
    torch.cuda.default_generators[torch.cuda.current_device()] through torch.cuda._lazy_call (which runs the
    callback at once because torch.cuda.is_initialized() is True here). model_parallel_cuda_manual_seed seeds
    the default state with torch.cuda.manual_seed; tensor_parallel.checkpoint (activation recomputation)
    saves and restores torch.cuda.get_rng_state around the recomputed forward. The whole family is
    replaced so that no getter and setter ever disagree about which generator is meant.
    """
    for name, stand_in in _RNG_FUNCTIONS.items():
        _patch(torch.cuda, name, stand_in)
        _patch(torch.cuda.random, name, stand_in)  # random.py's own names: megatron calls both spellings
    _patch(torch.cuda, "default_generators", (torch.default_generator,))
    # fork() warns when the CPU generator moved inside a CUDA-RNG region; here the two are one generator,
    # so every random op inside fork() (weight init, dropout) would trigger it. Drop only that message.
    global _log_filter
    _log_filter = _DropMessage("CPU RNG state changed within GPU RNG context")
    logging.getLogger("megatron.core.tensor_parallel.random").addFilter(_log_filter)


class _DropMessage(logging.Filter):
    def __init__(self, message: str):
        super().__init__()
        self.message = message

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def _synchronize(device: Any = None) -> None:
    return None


def _install_device_api() -> None:
    """The device-management calls megatron makes, answered for one emulated device 0."""
    # tensor_parallel/random._set_cuda_rng_state hands its state setter to torch.cuda._lazy_call, which
    # queues callbacks (forever, on a CPU build) until CUDA is initialised; initialised, it runs them now.
    # torch.cuda.memory keeps its own reference to the original, so memory statistics stay graceful zeros.
    _patch(torch.cuda, "is_initialized", lambda: True)
    # The device argument of megatron's allocations (DDP buffers, p2p shapes, MoE counts, optimizer).
    _patch(torch.cuda, "current_device", lambda: 0)
    # pipeline_parallel/p2p_communication._communicate: synchronize() after the batched isend/irecv
    # between pipeline stages; gloo's wait() already completed them.
    _patch(torch.cuda, "synchronize", _synchronize)


def _install_streams() -> None:
    """Synchronous stand-ins: on the CPU every kernel has finished when its call returns.

    moe/token_dispatcher.py (alltoall): MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() for its
    device-to-host copies of the split sizes, compares it with torch.cuda.current_stream(), enters
    torch.cuda.stream(...) and synchronises on the stream's record_event().
    """
    _patch(torch.cuda, "Stream", _Stream)
    _patch(torch.cuda, "Event", _Event)
    _patch(torch.cuda, "current_stream", lambda device=None: _DEFAULT_STREAM)
    _patch(torch.cuda, "stream", _StreamContext)


# --- collectives -----------------------------------------------------------------------------------------


def _int_list(sizes: Any) -> Any:
    return sizes if sizes is None or isinstance(sizes, list) else [int(n) for n in sizes]


def _install_collectives() -> None:
    """moe/token_dispatcher.py (alltoall): split sizes are moved to the host with
    moe_utils.maybe_move_tensor_to_cpu, which turns them into numpy arrays only for ``is_cuda`` tensors; ours
    are honest CPU tensors, so tensor_parallel/mappings._AllToAll hands torch tensors to
    all_to_all_single, whose c10d binding accepts only a sequence of Python ints."""
    original = torch.distributed.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, *args, **kwargs):
        return original(output, input, _int_list(output_split_sizes), _int_list(input_split_sizes), *args, **kwargs)

    _patch(torch.distributed, "all_to_all_single", all_to_all_single)


def install_cuda_redirect() -> None:
    """Make torch's CUDA API and CUDA device arguments work on the CPU (see the module docstring)."""
    global _installed
    if _installed:
        return
    _installed = True
    # torch's device context (`with torch.device("meta")`) recognises factory functions by identity in a set
    # built and cached on first use; built after our wrappers replace the factories, it would miss the
    # originals and the context would be silently ignored (transformers then builds HF models with garbage
    # RoPE buffers). Building it now keeps the originals in it.
    from torch.utils._device import _device_constructors

    _device_constructors()
    _install_device_api()
    _install_rng()
    _install_streams()
    _install_collectives()
    _install_device_mapping()


def uninstall_cuda_redirect() -> None:
    """Restore every attribute :func:`install_cuda_redirect` replaced, in reverse order."""
    global _installed, _log_filter
    if not _installed:
        return
    _installed = False
    table = torch.jit._builtins._get_builtin_table()
    while _script_aliases:
        table.pop(id(_script_aliases.pop()), None)
    while _patched:
        owner, name, original = _patched.pop()
        if original is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    if _log_filter is not None:
        logging.getLogger("megatron.core.tensor_parallel.random").removeFilter(_log_filter)
        _log_filter = None
