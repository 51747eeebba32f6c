"""Make Megatron-Core 0.16.1's *unmodified* code run on CPU under gloo (never active on CUDA).

Megatron-Core assumes CUDA in many places. Rather than patching its files on disk or vendoring
copies, each CUDA assumption is handled by one named function below. Every function installs
its workaround and returns an ``undo`` callable; ``enable_cpu_compat()`` installs them all (or
all but some, which is how the tests show that each one is needed), ``disable_cpu_compat()``
removes them again. Device/tensor-method redirections live in one ``TorchFunctionMode`` whose
handlers are switched on by the individual workarounds.

Workarounds (upstream = megatron-core 0.16.1, torch 2.13):

- ``patch_cuda_device_queries``: ``torch.cuda.current_device()`` (tensor_parallel/layers.py,
  mappings.py, moe/router.py, optimizer/...) raises without CUDA; it now returns the CPU device
  (this also covers factories that run in autograd backward, where modes are inactive).
- ``map_cuda_tensors_to_cpu``: ``device="cuda"`` / ``device=<int>`` factories, ``.cuda()``,
  ``.to("cuda")`` and ``.pin_memory()`` (optimizer/optimizer.py, clip_grads.py,
  pipeline_parallel/schedules.py, param_and_grad_buffer.py, ...).
- ``replace_cuda_streams_and_events``: ``torch.cuda.Stream/Event/stream/current_stream/
  synchronize`` (moe/token_dispatcher.py, distributed_data_parallel.py, p2p_communication.py).
- ``install_cpu_rng_tracker``: ``CudaRNGStatesTracker`` in tensor_parallel/random.py reads
  and writes the CUDA generator state.
- ``define_missing_te_general_gemm``: moe/moe_utils.py only binds ``te_general_gemm`` inside
  ``try: import transformer_engine``, then tests ``te_general_gemm is not None`` -> NameError.
- ``report_cuda_tensor_types_to_optimizer``: optimizer/optimizer.py, distrib_optimizer.py and
  clip_grads.py accept only ``param.type() == 'torch.cuda.FloatTensor'`` (and Half/BFloat16).
- ``keep_alltoall_splits_as_numpy``: moe/moe_utils.py ``maybe_move_tensor_to_cpu`` converts the
  alltoall split sizes to numpy only for CUDA tensors; on CPU they stay tensors and
  ``torch.distributed.all_to_all_single`` (gloo) rejects tensor split sizes.
- ``gather_variable_sizes_on_gloo``: tensor_parallel/mappings.py all-gathers unequal splits
  (alltoall dispatcher with expert-TP > 1 and EP > 1); gloo's allgather needs equal sizes.

Not handled here (by design): the default causal mask that DotProductAttention builds on CUDA
(our forward helpers always pass an explicit mask); the torch norm that refuses sequence
parallel (``sao_megatron.models.specs.SequenceParallelRMSNorm`` is given through the layer spec);
``psutil`` (a dependency in setup.py: without it the dist_checkpointing writer process dies and
the parent hangs).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

Undo = Callable[[], None]

# ---------------------------------------------------------------------------------------------
# One torch-function mode; workarounds switch its handlers on and off.


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):  # torch.cuda.current_device() returns an index
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


class _CpuCompatMode(TorchFunctionMode):
    """Maps CUDA device requests to CPU; spoofs CUDA tensor types for Megatron's optimiser."""

    def __init__(self) -> None:
        super().__init__()
        self.map_devices = False
        self.spoof_types = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.map_devices:
            if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
                return args[0]
            if "device" in kwargs and _is_cuda_device(kwargs["device"]):
                kwargs = {**kwargs, "device": "cpu"}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
                args = (args[0], "cpu", *args[2:])
        if (
            self.spoof_types
            and func is torch.Tensor.type
            and len(args) == 1
            and not kwargs
            and _caller_module().startswith("megatron.core.optimizer")
        ):
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if "cuda" not in name else name
        return func(*args, **kwargs)


def _caller_module() -> str:
    """Module name of the first frame outside torch and this file (for ``Tensor.type`` calls)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not (name.startswith("torch") or name == __name__):
            return name
        frame = frame.f_back
    return ""


_MODE = _CpuCompatMode()
_MODE_USERS: set[str] = set()


def _mode_acquire(user: str) -> None:
    if not _MODE_USERS:
        _MODE.__enter__()
    _MODE_USERS.add(user)


def _mode_release(user: str) -> None:
    _MODE_USERS.discard(user)
    if not _MODE_USERS:
        _MODE.__exit__(None, None, None)


def _set_attrs(obj: object, values: dict[str, object]) -> Undo:
    """Set attributes on ``obj``; return a function restoring the old ones (or deleting new)."""
    missing = object()
    old = {name: getattr(obj, name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)

    def undo() -> None:
        for name, value in old.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)

    return undo


# ---------------------------------------------------------------------------------------------
# The workarounds.


def patch_cuda_device_queries() -> Undo:
    """``torch.cuda.current_device()`` -> ``torch.device("cpu")``; ``set_device`` -> no-op.

    Upstream (megatron-core 0.16.1): ``device=torch.cuda.current_device()`` in
    tensor_parallel/layers.py, tensor_parallel/mappings.py, moe/router.py, moe/experts.py,
    pipeline_parallel/p2p_communication.py, optimizer/distrib_optimizer.py; torch raises
    "Torch not compiled with CUDA enabled" without a GPU. Returning a CPU *device* (not an
    index) matters: several of these factories run inside autograd ``backward`` (e.g.
    ``LinearWithGradAccumulationAndAsyncCommunication.backward`` gathering the sequence-parallel
    input), where torch-function modes are not active, so ``map_cuda_tensors_to_cpu`` cannot
    redirect them.
    """
    cpu = torch.device("cpu")
    return _set_attrs(
        torch.cuda, {"current_device": lambda: cpu, "set_device": lambda device: None}
    )


def map_cuda_tensors_to_cpu() -> Undo:
    """Route ``device="cuda"``/``device=<int>`` factories, ``.to("cuda")``, ``.cuda()`` and
    ``.pin_memory()`` to CPU through a ``TorchFunctionMode`` (active in the thread that enabled
    it, outside autograd backward).

    Upstream (megatron-core 0.16.1): ``torch.zeros(..., device="cuda")`` in
    pipeline_parallel/schedules.py (``total_num_tokens``), optimizer/optimizer.py
    (``found_inf``, ``_scale``), optimizer/clip_grads.py; ``torch.empty(...,
    device=torch.cuda.current_device())`` all over tensor_parallel; ``.cuda()`` in
    optimizer/distrib_optimizer.py; ``pin_memory`` in the dist_checkpointing/offload paths.
    """
    _MODE.map_devices = True
    _mode_acquire("map_cuda_tensors_to_cpu")

    def undo() -> None:
        _MODE.map_devices = False
        _mode_release("map_cuda_tensors_to_cpu")

    return undo


class _CpuStream(torch.cpu.Stream):
    """``torch.cuda.Stream`` stand-in: accepts CUDA keyword arguments, everything is a no-op."""

    def __new__(cls, device=None, priority=0, **kwargs):
        return super().__new__(cls)

    def __init__(self, device=None, priority=0, **kwargs):
        super().__init__()

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return _CpuEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class _CpuEvent:
    """``torch.cuda.Event`` stand-in: CPU work is synchronous, so every event is complete."""

    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        pass

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_DEFAULT_CPU_STREAM = None


def replace_cuda_streams_and_events() -> Undo:
    """Replace ``torch.cuda.{Stream, Event, stream, current_stream, default_stream,
    synchronize}`` by synchronous CPU stand-ins.

    Upstream (megatron-core 0.16.1): ``MoEAlltoAllTokenDispatcher.__init__`` creates
    ``torch.cuda.Stream()`` (moe/token_dispatcher.py) and switches streams in
    ``_maybe_dtoh_and_synchronize``; distributed/param_and_grad_buffer.py and
    pipeline_parallel/p2p_communication.py call ``torch.cuda.synchronize()`` /
    ``default_stream()``; torch raises "torch.cuda.Stream requires CUDA support".
    """
    global _DEFAULT_CPU_STREAM
    if _DEFAULT_CPU_STREAM is None:
        _DEFAULT_CPU_STREAM = _CpuStream()
    default = _DEFAULT_CPU_STREAM
    return _set_attrs(
        torch.cuda,
        {
            "Stream": _CpuStream,
            "Event": _CpuEvent,
            "stream": lambda stream=None: torch.cpu.StreamContext(None),
            "current_stream": lambda device=None: default,
            "default_stream": lambda device=None: default,
            "synchronize": lambda device=None: None,
        },
    )


def install_cpu_rng_tracker() -> Undo:
    """Install a model-parallel RNG tracker that forks the CPU generator.

    Upstream (megatron-core 0.16.1) tensor_parallel/random.py: ``CudaRNGStatesTracker.add``
    calls ``torch.cuda.get_rng_state()`` and ``fork`` calls ``_set_cuda_rng_state``, both need
    CUDA. ``model_parallel_cuda_manual_seed`` keeps an already initialised tracker (unless
    ``force_reset_rng``), so installing ours as ``_CUDA_RNG_STATE_TRACKER`` is enough.
    """
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Same bookkeeping as upstream; the states are CPU generator states."""

        def add(self, name, seed):  # noqa: D401 - mirrors upstream
            self._is_initialized = True
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            gen = torch.Generator()
            gen.manual_seed(seed)
            self.states_[name] = gen.get_state()

        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            import contextlib

            @contextlib.contextmanager
            def _fork():
                if name not in self.states_:
                    raise Exception(f"rng state {name} is not added")
                orig = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(orig)

            return _fork()

    return _set_attrs(
        mrandom,
        {
            "_CUDA_RNG_STATE_TRACKER": CpuRNGStatesTracker(),
            "_CUDA_RNG_STATE_TRACKER_INITIALIZED": True,
        },
    )


def define_missing_te_general_gemm() -> Undo:
    """Bind ``megatron.core.transformer.moe.moe_utils.te_general_gemm = None`` without TE.

    Upstream (megatron-core 0.16.1) moe/moe_utils.py imports ``te_general_gemm`` only inside
    ``try: import transformer_engine``; ``RouterGatingLinearFunction.forward`` then evaluates
    ``te_general_gemm is not None`` -> ``NameError`` on every router forward.
    """
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    return _set_attrs(moe_utils, {"te_general_gemm": None})


def report_cuda_tensor_types_to_optimizer() -> Undo:
    """Make ``Tensor.type()`` answer ``'torch.cuda.FloatTensor'`` (etc.) to callers inside
    ``megatron.core.optimizer`` only.

    Upstream (megatron-core 0.16.1): optimizer/optimizer.py
    (``Float16OptimizerWithFloat16Params.__init__``), optimizer/distrib_optimizer.py
    (``_build_model_and_main_param_groups``) raise TypeError for any ``param.type()`` that is not
    a ``torch.cuda.*Tensor``; optimizer/clip_grads.py asserts ``param.grad.type() ==
    'torch.cuda.FloatTensor'``.
    """
    _MODE.spoof_types = True
    _mode_acquire("report_cuda_tensor_types_to_optimizer")

    def undo() -> None:
        _MODE.spoof_types = False
        _mode_release("report_cuda_tensor_types_to_optimizer")

    return undo


def keep_alltoall_splits_as_numpy() -> Undo:
    """Convert CPU tensors to numpy in ``maybe_move_tensor_to_cpu(..., as_numpy=True)``.

    Upstream (megatron-core 0.16.1) moe/moe_utils.py ``maybe_move_tensor_to_cpu`` converts only
    ``tensor.is_cuda`` tensors, so on CPU ``MoEAlltoAllTokenDispatcher`` passes
    ``input_splits``/``output_splits`` as tensors to ``all_to_all_single``, which gloo rejects
    ("split sizes" must be a list of ints). The token dispatcher binds the name at import, so
    the wrapper is set on moe/token_dispatcher.py.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    upstream = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return upstream(tensor, as_numpy=as_numpy, record_stream=record_stream)

    return _set_attrs(token_dispatcher, {"maybe_move_tensor_to_cpu": maybe_move_tensor_to_cpu})


def gather_variable_sizes_on_gloo() -> Undo:
    """Variable-size all-gather over gloo groups: pad every split to the largest one,
    ``all_gather_into_tensor``, then drop the padding.

    Upstream (megatron-core 0.16.1) tensor_parallel/mappings.py ``_gather_along_first_dim``
    with ``output_split_sizes`` calls ``torch.distributed.all_gather`` with unequal tensors;
    gloo raises "ProcessGroupGloo::allgather: invalid tensor size". The alltoall token
    dispatcher does this when expert_tensor_parallel_size > 1 and expert_model_parallel_size > 1
    (tokens per rank differ after routing). Only gloo groups take the new path; the autograd
    Functions in mappings.py look the name up at call time. (The matching variable-size
    ``reduce_scatter`` works on gloo in torch 2.13, so it is left alone.)
    """
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    upstream = mappings._gather_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if (
            output_split_sizes is None
            or group is None
            or group.size() == 1
            or dist.get_backend(group) != "gloo"
        ):
            return upstream(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(n) for n in output_split_sizes]
        most = max(sizes)
        padded = input_.new_zeros((most, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        out = input_.new_empty((most * len(sizes), *input_.shape[1:]))
        dist.all_gather_into_tensor(out, padded, group=group)
        return torch.cat([out[i * most : i * most + n] for i, n in enumerate(sizes)])

    return _set_attrs(mappings, {"_gather_along_first_dim": _gather_along_first_dim})


WORKAROUNDS: dict[str, Callable[[], Undo]] = {
    fn.__name__: fn
    for fn in (
        patch_cuda_device_queries,
        map_cuda_tensors_to_cpu,
        replace_cuda_streams_and_events,
        install_cpu_rng_tracker,
        define_missing_te_general_gemm,
        report_cuda_tensor_types_to_optimizer,
        keep_alltoall_splits_as_numpy,
        gather_variable_sizes_on_gloo,
    )
}
"""All workarounds by name, in installation order."""

_ACTIVE: dict[str, Undo] = {}


def enable_cpu_compat(exclude: Iterable[str] = ()) -> tuple[str, ...]:
    """Install the CPU workarounds (idempotent); returns the names now active.

    Args:
        exclude: workaround names (keys of ``WORKAROUNDS``) to leave out; used by tests to show
            that the upstream call fails without that one workaround.

    On a CUDA machine this is a no-op returning ``()`` (nothing here is ever active there).
    The ``TorchFunctionMode`` of ``map_cuda_tensors_to_cpu`` is per thread: call this from the
    thread that runs Megatron (``initialize_parallel`` does).

    Raises:
        ValueError: an ``exclude`` name that is not a workaround.
    """
    if torch.cuda.is_available():
        assert not _ACTIVE, "CPU compat must never be active on a CUDA machine"
        return ()
    exclude = set(exclude)
    unknown = exclude - set(WORKAROUNDS)
    if unknown:
        raise ValueError(f"exclude={sorted(unknown)}: unknown workaround(s); see WORKAROUNDS")
    for name, install in WORKAROUNDS.items():
        if name not in exclude and name not in _ACTIVE:
            _ACTIVE[name] = install()
    return active_workarounds()


def disable_cpu_compat(names: Iterable[str] | None = None) -> None:
    """Remove the given workarounds (default: all), in reverse installation order."""
    names = list(_ACTIVE) if names is None else list(names)
    for name in reversed(list(_ACTIVE)):
        if name in names:
            _ACTIVE.pop(name)()


def active_workarounds() -> tuple[str, ...]:
    """Names of the workarounds currently installed."""
    return tuple(_ACTIVE)
