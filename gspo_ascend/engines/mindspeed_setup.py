"""How the megatron engine configures the real MindSpeed (branch core_r0.16.0, pinned, and the previous line's
26.1.0_core_r0.12.1 and 2.2.0_core_r0.12.1; docs/mindspeed-branches.md has what differs between them for us) for a
Config.

How MindSpeed chooses what to patch (read from its source, ``mindspeed/megatron_adaptor.py``,
``args_utils.py``, ``features_manager/``):

* ``import mindspeed.megatron_adaptor`` runs ``patch_features()`` once per process: ``get_mindspeed_args()``
  parses ``sys.argv`` (every feature registers its flags; unknown ``--flags`` are kept too) and caches the result,
  then ``MindSpeedFeaturesManager`` calls ``pre_register_patches`` and ``register_patches`` of every feature whose
  ``is_need_apply(args)`` holds and applies the registered patches. In a Ray actor ``sys.argv`` is Ray's.
* ``is_need_apply``: features of optimisation level 0 always apply (megatron basics, PTNorm = fused RMSNorm,
  fused RoPE / SwiGLU / softmax function replacements, the grouped-matmul helpers); level-2 features apply when
  ``args.<feature_name>`` is truthy (``use_flash_attn``, ``moe_grouped_gemm``, ``use_ascend_mc2``), a few override
  it (the CP feature always applies and registers its patches only when ``context_parallel_size > 1``). A
  feature's ``register_patches`` then reads further megatron arguments (``sequence_parallel``,
  ``tensor_model_parallel_size``, ``context_parallel_size``, ...) from the same namespace.
* ``repatch(args_dict)`` removes every patch, sets the dict's keys on the argument namespace (megatron's global
  args when ``megatron.training`` has them, else the cached MindSpeed args) and applies the features again. The
  patched code reads that same namespace at run time (``get_full_args()``: e.g. fused RoPE reads
  ``use_fused_rotary_pos_emb``), so the values stay in force after the call. MindSpeed's
  ``TransformerConfig.__init__`` wrapper also merges that namespace into every TransformerConfig built afterwards:
  keys that are TransformerConfig fields become defaults (explicit keyword arguments win), the others become
  per-instance fields (``config.use_flash_attn``); no engine needs to pass them itself.
* MC2: in this branch the adaptor's flag is ``use_ascend_mc2`` (MC2 linear layers, only with TP > 1 and sequence
  parallelism). ``--moe-bmm-mc2`` exists only in the legacy ``mindspeed/arguments.py`` and is read by MoE
  functions the features-manager adaptor never installs; 2.2.0 has no ``--moe-alltoall-mc2`` (26.1.0 adds one, which
  we do not set). 26.1.0 refuses ``use_ascend_mc2`` without TP > 1 and SP (an AssertionError) where 2.2.0 warned and
  ran without MC2; :func:`check_mc2` refuses it first either way.

So the engine imports the adaptor with a neutral ``sys.argv`` (MindSpeed's defaults, never the launcher's
arguments) and then calls ``repatch`` with :func:`mindspeed_args` (:func:`apply`). Every key is set explicitly,
False included, so a second ``repatch`` for another config leaves nothing of the first behind.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from collections.abc import Iterator
from typing import Any

from gspo_ascend.config import Config
from gspo_ascend.errors import ConfigError

_last: dict[str, tuple[str, ...]] | None = None


def installed() -> bool:
    """Whether the real MindSpeed adaptor is importable (not PyPI's empty ``mindspeed`` placeholder)."""
    try:
        return importlib.util.find_spec("mindspeed.megatron_adaptor") is not None
    except ImportError:  # no `mindspeed` package at all
        return False


def enabled(backend: Any) -> bool:
    """Whether the megatron engine runs under MindSpeed on ``backend`` (a :class:`gspo_ascend.device.Backend`).

    A real NPU: always (a missing MindSpeed is an error there). The emulated NPU (the CPU shim,
    ``GSPO_DEVICE_SHIM=1``): when the real MindSpeed is installed, i.e. in ``.venv-mindspeed``
    (``scripts/check_mindspeed.sh``); CI's main venv has none and keeps megatron's plain local spec, as before.
    CPU and CUDA: never.
    """
    if getattr(backend, "name", None) != "npu":
        return False
    return True if not backend.emulated else installed()


def installed_branch() -> str | None:
    """The installed MindSpeed branch as doctor names it (read from its files, nothing imported), or None."""
    from ..doctor.packages import mindspeed_branch, mindspeed_package_dir

    found = mindspeed_branch(mindspeed_package_dir())
    return found[0] if found else None


def check_mc2(cfg: Config) -> None:
    """``actor.use_mc2`` is MindSpeed's ``use_ascend_mc2``: MC2 linear layers replace megatron's column / row
    parallel linears only with TP > 1 and sequence parallelism (``features_manager/tensor_parallel/mc2.py``);
    anything else is refused rather than silently running without MC2."""
    a = cfg.actor
    if a.use_mc2 and not (a.tensor_parallel_size > 1 and a.sequence_parallel):
        raise ConfigError(
            "config key 'actor.use_mc2' (MindSpeed use_ascend_mc2) needs actor.tensor_parallel_size > 1 and "
            f"actor.sequence_parallel: true (got {a.tensor_parallel_size} and {a.sequence_parallel}); "
            "set them or set actor.use_mc2: false"
        )
    if a.use_mc2 and cfg.model.dtype == "float32":  # torch_npu 2.7.1 op docs: "数据类型支持float16、bfloat16、int8"
        raise ConfigError(
            "config key 'actor.use_mc2' needs model.dtype bfloat16 or float16: torch_npu's MC2 kernels "
            "(npu_all_gather_base_mm, npu_mm_reduce_scatter_base) take no float32; set model.dtype: bfloat16"
        )


# The roots of MindSpeed's patch targets that code outside megatron calls (vLLM included): torch, and the
# standard library's importlib / math. Its other targets are megatron's own or stand-in modules it creates.
PROCESS_WIDE_ROOTS = ("torch", "importlib", "math")


@contextlib.contextmanager
def patches_lifted() -> Iterator[list[str]]:
    """Run the body with MindSpeed's process-wide patches taken off, and put them back after.

    vLLM with rollout TP > 1 runs in the training process (``external_launcher``), where MindSpeed's adaptor has
    patched torch for every module: ``Tensor.view`` of a non-contiguous tensor returns a view of a *copy* (writes
    through it are lost: a KV-cache or weight write through such a view would silently vanish), ``torch.compile``
    is a pass-through (no ACL graphs), ``Tensor.type`` says "cuda" for "npu", a float64 ``all_reduce`` goes
    through float32. vllm-ascend was written against plain torch, and auditing every view of its forward is not
    possible without an NPU; so the rollout engine runs each of its vLLM calls (build, generate, weight load,
    sleep / wake-up) in this context instead, with torch exactly as torch_npu leaves it.

    For every applied MindSpeed patch under :data:`PROCESS_WIDE_ROOTS`, every holder of the patched function (the
    target, e.g. ``torch.Tensor``, and every module MindSpeed rebound: it rebinds each module attribute of the same
    name that held the original) gets MindSpeed's recorded original back; on exit each holder that still has the
    original gets the patched function again. Yields the lifted targets ([] without MindSpeed in the process, when
    this is a no-op). Nested use lifts nothing more. Not thread-safe: the training process calls vLLM and megatron
    from one thread, one at a time.
    """
    utils = sys.modules.get("mindspeed.patch_utils")
    if utils is None:
        yield []
        return
    swapped: list[tuple[Any, str, Any, Any]] = []
    lifted: list[str] = []
    for target, patch in utils.MindSpeedPatchesManager.patches_info.items():
        patched, orig, name = patch.final_patch_func, patch.orig_func, patch.orig_func_name
        if target.split(".")[0] not in PROCESS_WIDE_ROOTS or not patch.is_applied or name is None:
            continue
        if patched is None or patched is orig:
            continue
        holders = {id(h): h for h in (patch.orig_module, *list(sys.modules.values()))}  # some are unhashable
        count = len(swapped)
        for holder in holders.values():
            if _attr(holder, name) is patched:
                setattr(holder, name, orig)
                swapped.append((holder, name, orig, patched))
        if len(swapped) > count:
            lifted.append(target)
    try:
        yield lifted
    finally:
        for holder, name, orig, patched in reversed(swapped):
            if _attr(holder, name) is orig:
                setattr(holder, name, patched)


def _attr(holder: Any, name: str) -> Any:
    try:
        return vars(holder).get(name)  # own attributes only: a class's inherited method is not rebound there
    except TypeError:  # no __dict__
        return None


def mindspeed_args(cfg: Config, *, moe: bool) -> dict[str, Any]:
    """The MindSpeed argument values our engine runs with for ``cfg`` (``moe``: the model has experts).

    Fused kernels on (flash attention, fused RMSNorm / RoPE / SwiGLU; grouped GEMM for experts), MC2 when
    ``actor.use_mc2`` (refused without TP > 1 and SP: :func:`check_mc2`), MindSpeed's ring CP algorithm when
    ``actor.context_parallel_size > 1``, and the megatron arguments MindSpeed's features read when they register
    their patches.
    """
    check_mc2(cfg)
    a = cfg.actor
    cp = a.context_parallel_size
    return {
        "optimization_level": 2,  # MindSpeed's default: level-2 features (flash attention, CP, MC2, GMM) allowed
        # fused kernels
        "use_flash_attn": True,
        "use_fused_rmsnorm": True,
        "use_fused_rotary_pos_emb": True,
        # no "use_fused_swiglu": in 2.2.0 only the legacy arguments.py reads it; fused SwiGLU comes from the
        # always-on swiglu feature through megatron's bias_activation_fusion (the engine sets it)
        "moe_grouped_gemm": bool(moe),
        "moe_permute_fusion": False,  # not asked for (torch_npu 2.7.1 has its routing-map permute ops; the shim not)
        "use_ascend_mc2": bool(a.use_mc2),
        # parallel layout (MC2 needs TP > 1 with SP; CP registers its attention for CP > 1)
        "tensor_model_parallel_size": a.tensor_parallel_size,
        "pipeline_model_parallel_size": a.pipeline_parallel_size,
        "context_parallel_size": cp,
        "expert_model_parallel_size": a.expert_parallel_size,
        "expert_tensor_parallel_size": a.expert_tensor_parallel_size,
        "sequence_parallel": bool(a.sequence_parallel and a.tensor_parallel_size > 1),
        "context_parallel_algo": "megatron_cp_algo",  # the ring algorithm: Megatron's chunk layout (megatron_cp.py)
        "attention_mask_type": "causal",
        "reset_position_ids": False,  # read by MindSpeed's CP RoPE slicing (get_pos_emb_on_this_cp_rank)
        # model facts MindSpeed's features read
        "position_embedding_type": "rope",
        "moe_token_dispatcher_type": "alltoall",  # mbridge's choice for every model (megatron needs it for
        # variable_seq_lengths); MindSpeed copies known keys into every TransformerConfig (module docstring)
        # no FP8 (megatron-core's TransformerConfig default). MindSpeed 26.1.0's grouped GEMM reads args.fp8 at run
        # time (core/transformer/moe/grouped_matmul_util.py get_gmm_quant_func); on the cluster Megatron-LM's
        # parse_args defines it, and our engines never run that parser, so the key is ours to set
        "fp8": None,
    }


@contextlib.contextmanager
def _neutral_argv() -> Iterator[None]:
    """MindSpeed parses sys.argv when its adaptor is imported: show it only the program name."""
    saved = sys.argv
    sys.argv = saved[:1] or ["gspo-ascend"]
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _recording(manager: type, features: list[Any]) -> Iterator[dict[str, list[str]]]:
    """Record which feature registers which patch target while MindSpeed (re)applies its features.

    Wraps, for the duration of the block, ``MindSpeedPatchesManager.register_patch`` (calls through unchanged)
    and each feature instance's ``pre_register_patches`` / ``register_patches`` (to know who is registering).
    """
    records: dict[str, list[str]] = {}
    current: list[str | None] = [None]
    saved_register = vars(manager)["register_patch"]
    register = saved_register.__func__ if isinstance(saved_register, staticmethod) else saved_register

    def recording_register(orig_func_name: str, *args: Any, **kwargs: Any) -> Any:
        if current[0] is not None:
            records.setdefault(current[0], []).append(orig_func_name)
        return register(orig_func_name, *args, **kwargs)

    def attributed(feature: Any, hook: str) -> Any:
        bound = getattr(feature, hook)

        def call(patch_manager: Any, args: Any) -> Any:
            current[0] = feature.feature_name
            records.setdefault(feature.feature_name, [])
            try:
                return bound(patch_manager, args)
            finally:
                current[0] = None

        return call

    manager.register_patch = staticmethod(recording_register)
    wrapped = []
    try:
        for feature in features:
            for hook in ("pre_register_patches", "register_patches"):
                setattr(feature, hook, attributed(feature, hook))  # an instance attribute shadows the method
                wrapped.append((feature, hook))
        yield records
    finally:
        manager.register_patch = saved_register
        for feature, hook in wrapped:
            vars(feature).pop(hook, None)


def _settle_flash_attn_checks() -> None:
    """Run transformers' flash-attention checks with MindSpeed's dummy ``flash_attn`` module out of the way.

    MindSpeed core_r0.16.0 registers ``flash_attn.flash_attn_interface.flash_attn_unpadded_func`` with
    ``create_dummy=True`` (features_manager/megatron_basic/requirements_basic.py:58), which puts an empty
    ``flash_attn`` into sys.modules. transformers 5.5.4 (vllm-ascend 0.23.0's pin) then finds that module by spec and
    indexes ``packages_distributions()["flash_attn"]``, a KeyError since no distribution provides it
    (utils/import_utils.py:951 and :982, :970 for FA3; later releases use ``.get``). MindSpeed reaches the check
    itself: its patch manager probes ``hasattr`` on every module in sys.modules, and transformers 5.5's
    ``image_processing_*_fast`` alias modules import their image processors, and through them the flash-attention
    integration, on any attribute. The checks are ``lru_cache``d: run here, with a dummy from an adaptor imported
    earlier in the process hidden (a module whose spec has no loader, which no installed package is), they give the
    true answer (no flash-attn on an NPU) for the rest of the process. On the 0.12.1 branches and on later
    transformers this changes nothing.
    """
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    dummies = {}
    for name in ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn_interface"):
        spec = getattr(sys.modules.get(name), "__spec__", None)
        if spec is not None and spec.loader is None:
            dummies[name] = sys.modules.pop(name)
    try:
        for check in ("is_flash_attn_2_available", "is_flash_attn_3_available", "is_flash_attn_4_available"):
            if hasattr(import_utils, check):
                getattr(import_utils, check)()
    finally:
        sys.modules.update(dummies)


def apply(args: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """Import ``mindspeed.megatron_adaptor`` (neutral argv) and ``repatch`` it with ``args``.

    Returns, like :func:`registered_features` afterwards, the features that registered patches, each with the
    patch targets (``"megatron.core....DotProductAttention.forward"``) it registered. On the CPU shim, install it
    first: ``shim.install(mindspeed=True)``; the adaptor must be imported before megatron.core.
    """
    global _last
    _settle_flash_attn_checks()
    with _neutral_argv():
        import mindspeed.megatron_adaptor as adaptor
    from mindspeed.features_manager import MindSpeedFeaturesManager
    from mindspeed.patch_utils import MindSpeedPatchesManager

    with _recording(MindSpeedPatchesManager, MindSpeedFeaturesManager.FEATURES_LIST) as records:
        adaptor.repatch(dict(args))
    _last = {name: tuple(dict.fromkeys(targets)) for name, targets in records.items() if targets}
    _fix_float64_all_reduce(MindSpeedPatchesManager)
    _fix_mc2_tp_group(MindSpeedPatchesManager)
    return dict(_last)


ALL_REDUCE = "torch.distributed.all_reduce"


def float64_all_reduce_copy_back_wrapper(fn: Any) -> Any:
    """``torch.distributed.all_reduce`` for float64 tensors as MindSpeed means it, with the result kept.

    MindSpeed 2.2.0's ``torch_all_reduce_double_dtype_bypass_wrapper`` (``core/megatron_basic/
    requirements_basic.py``, installed process-wide at adaptor import) reduces a float32 *copy* of a float64
    tensor (HCCL's all-reduce has no float64) and returns without writing it back: the caller's tensor keeps
    its local value, so every float64 all-reduce of the process silently becomes a no-op. Our engines reduce
    token counts, micro-batch counts, the skip flag and metric sums in float64. This wrapper, outermost,
    reduces the float32 copy itself and copies it back (float32 is exact for counts below 2**24 and ~1e-7
    relative for sums); other dtypes pass through unchanged. Installed by :func:`apply` through MindSpeed's own
    patch manager, so MindSpeed's next ``repatch`` removes it with its own wrapper and :func:`apply` adds it
    again.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        in_kwargs = not args
        tensor = kwargs["tensor"] if in_kwargs else args[0]
        if not (torch.is_tensor(tensor) and tensor.dtype == torch.float64):
            return fn(*args, **kwargs)
        reduced = tensor.float()
        if in_kwargs:
            kwargs = {**kwargs, "tensor": reduced}
        else:
            args = (reduced, *args[1:])
        handle = fn(*args, **kwargs)
        if handle is not None:
            handle.wait()
        tensor.copy_(reduced)
        return None

    return wrapper


def _fix_float64_all_reduce(manager: type) -> None:
    """Wrap MindSpeed's float64 all-reduce bypass (when this MindSpeed installs one) with
    :func:`float64_all_reduce_copy_back_wrapper` and apply it (MindSpeed rebinds every module's reference)."""
    patch = manager.patches_info.get(ALL_REDUCE)
    if patch is None or not patch.wrappers or float64_all_reduce_copy_back_wrapper in patch.wrappers:
        return
    manager.register_patch(ALL_REDUCE, float64_all_reduce_copy_back_wrapper)
    manager.apply_patches()


MC2_LINEARS = (
    "megatron.core.tensor_parallel.layers.ColumnParallelLinear",
    "megatron.core.tensor_parallel.layers.RowParallelLinear",
)


def mc2_tp_group_wrapper(cls: type) -> type:
    """MindSpeed core_r0.16.0's MC2 linear ``cls`` (``core/tensor_parallel/mc2_feature/adaptor.py``), taking the
    ``tp_group`` megatron-core 0.16 passes every column / row parallel linear (``transformer/attention.py:360``,
    ``tensor_parallel/layers.py``): MindSpeed's ``__init__`` takes none (a TypeError at model build, so MC2 could
    not run on the pinned NPU line) and runs on the TP group of megatron's parallel state instead. The group
    megatron passes is checked to be that one (the only group our layouts give a non-expert linear: MindSpeed's own
    expert branch never fires, ``getattr(kwargs, 'is_expert')`` reads a dict's attribute) and kept as the linear's
    ``tp_group``, as megatron's own linears keep it. Installed through MindSpeed's patch manager as a wrapper of its
    replacement, so MindSpeed's next ``repatch`` removes it with its own and :func:`apply` adds it again."""

    def __init__(self, *args: Any, tp_group: Any = None, **kwargs: Any) -> None:
        from megatron.core import parallel_state

        own = parallel_state.get_tensor_model_parallel_group()
        if tp_group is not None and tp_group is not own:
            raise RuntimeError(
                f"MindSpeed's MC2 linear {cls.__name__} runs on megatron's tensor-parallel group, but megatron-core "
                "built it with another tp_group (an expert linear's, on an MoE model without grouped GEMM); set "
                "actor.use_mc2: false for this layout"
            )
        cls.__init__(self, *args, **kwargs)
        self.tp_group = own

    return type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": cls.__qualname__})


def _fix_mc2_tp_group(manager: type) -> None:
    """Wrap MindSpeed's MC2 linears with :func:`mc2_tp_group_wrapper` where MC2 registered them and they lack
    megatron's ``tp_group`` argument (core_r0.16.0 on megatron-core 0.16; 26.1.0's on 0.12.1 have no such argument
    to take), and apply it. Runs after MindSpeed applied its patches, so each holds megatron's original class."""
    import inspect

    changed = False
    for target in MC2_LINEARS:
        patch = manager.patches_info.get(target)
        if patch is None or patch.patch_func is None or mc2_tp_group_wrapper in patch.wrappers:
            continue
        megatron_takes = patch.orig_func is not None and "tp_group" in inspect.signature(patch.orig_func).parameters
        # MindSpeed's adaptor class passes **kwargs on to its MC2*Impl, whose __init__ names what it takes
        impl = next((c for c in patch.patch_func.__mro__ if c.__name__.endswith("ParallelLinearImpl")), None)
        if megatron_takes and impl is not None and "tp_group" not in inspect.signature(impl.__init__).parameters:
            manager.register_patch(target, mc2_tp_group_wrapper)
            changed = True
    if changed:
        manager.apply_patches()


def registered_features() -> dict[str, tuple[str, ...]]:
    """The features the last :func:`apply` registered (feature name -> patch targets); {} before any."""
    return dict(_last or {})


def runtime_args() -> Any:
    """The argument namespace MindSpeed's patched code reads at run time (``get_full_args()``)."""
    from mindspeed.args_utils import get_full_args

    return get_full_args()


def ends_for_flash_attention(models: Any) -> None:
    """Packed (THD) micro-batches under MindSpeed: each core attention of ``models`` gets the sequences' ends only.

    megatron-core's THD RoPE needs the boundaries with their leading 0 (``cu_seqlens``); MindSpeed's flash
    attention hands ``packed_seq_params.cu_seqlens_q`` to ``npu_fusion_attention``'s TND ``actual_seq_qlen`` as it is
    (core_r0.16.0 and 26.1.0 ``core/transformer/flash_attention/flash_attention/adaptor.py``: a list as it is, a
    tensor through ``.tolist()``), and torch_npu documents cumulative ends without a leading 0 (lengths [2, 2, 2] ->
    [2, 4, 6]). So a forward pre-hook gives the core attention a copy of the params with the ends as lists
    (MindSpeed's list branch; the engine keeps the boundaries on the host, so no device read); RoPE, which megatron's
    attention applies before it, keeps the original."""
    import dataclasses

    def ends_only(_module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        params = kwargs.get("packed_seq_params")
        if params is None or isinstance(params.cu_seqlens_q, list):
            return None
        q = params.cu_seqlens_q.tolist()[1:]
        kv = q if params.cu_seqlens_kv is params.cu_seqlens_q else params.cu_seqlens_kv.tolist()[1:]
        return args, {**kwargs, "packed_seq_params": dataclasses.replace(params, cu_seqlens_q=q, cu_seqlens_kv=kv)}

    for model in models:
        for module in model.modules():
            if hasattr(module, "core_attention"):
                module.core_attention.register_forward_pre_hook(ends_only, with_kwargs=True)
