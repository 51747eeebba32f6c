"""Layout-independent weight initialisation for CPU runs (same seed -> same model in any layout).

Megatron-Core 0.16.1 with ``use_cpu_initialization=True`` draws every weight from the process's
CPU generator (tensor_parallel/layers.py ``_initialize_affine_weight_cpu``). That is TP-consistent
(the full matrix is drawn, then sliced) but not EP/PP-consistent: every EP rank draws its local
experts from the same generator state, so global experts e and e + num_experts/ep start
identical (a silent symmetry for from-scratch MoE training), and later pipeline stages do not
see the generator advanced by earlier ones. On GPU Megatron forks per-EP/TP RNG streams and this
module is not used.

Here each parameter's *full* tensor is drawn from a generator seeded by (seed, global parameter
name) with Megatron's default init, then sliced to this rank with ``shard_state_dict``:

- weights: N(0, init_method_std^2); output projections (``linear_proj``, ``linear_fc2``):
  N(0, init_method_std^2 / (2 * num_layers)) (Megatron ``scaled_init_method_normal``; GPT-2,
  Radford et al. 2019, sec. 2.3);
- norm weights: 1; biases: 0;
- the value head keeps its explicit ``ValueHead.reset_parameters`` init.
"""

from __future__ import annotations

import math
import zlib

import torch
from megatron.core.transformer import TransformerConfig

from sao_megatron.models.builders import ValueHead
from sao_megatron.models.sharding import local_to_global_names, shard_rule, shard_state_dict

_OUTPUT_PROJECTIONS = ("linear_proj.weight", "linear_fc2.weight")


def full_init_tensor(
    global_name: str, shape: list[int], dtype: torch.dtype, seed: int, config: TransformerConfig
) -> torch.Tensor:
    """The full (unsharded) initial value of parameter ``global_name``."""
    if global_name.endswith("bias"):
        return torch.zeros(shape, dtype=dtype)
    module = global_name.rsplit(".", 2)[-2] if global_name.count(".") >= 1 else ""
    if "norm" in module:  # input_layernorm, pre_mlp_layernorm, q/k_layernorm, final_layernorm
        return torch.ones(shape, dtype=dtype)
    std = config.init_method_std
    if global_name.endswith(_OUTPUT_PROJECTIONS):
        std = std / math.sqrt(2.0 * config.num_layers)
    gen = torch.Generator().manual_seed(
        (seed * 1_000_003 + zlib.crc32(global_name.encode())) % 2**62
    )
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(dtype)


@torch.no_grad()
def init_layout_independent(
    chunk: torch.nn.Module,
    config: TransformerConfig,
    seed: int,
    *,
    tp_rank: int,
    tp_size: int,
    ep_rank: int,
    etp_rank: int = 0,
    etp_size: int = 1,
) -> None:
    """Re-initialise ``chunk``'s parameters so that they equal this rank's slice of the 1-rank
    model initialised with the same ``seed`` (coordinates as in ``shard_state_dict``)."""
    params = dict(chunk.named_parameters())
    local_state = chunk.state_dict()
    value_head = isinstance(getattr(chunk, "output_layer", None), ValueHead)
    sizes = {"tp": tp_size, "etp": etp_size, "none": 1}
    full = {}
    for local, global_name in local_to_global_names(chunk, ep_rank).items():
        value = local_state[local]
        if local not in params or (value_head and global_name.startswith("output_layer.")):
            full[global_name] = value
            continue
        group, dim, _ = shard_rule(global_name)
        shape = list(value.shape)
        if dim is not None:
            shape[dim] *= sizes[group]
        full[global_name] = full_init_tensor(global_name, shape, value.dtype, seed, config)
    sliced = shard_state_dict(
        full,
        chunk,
        tp_rank=tp_rank,
        tp_size=tp_size,
        ep_rank=ep_rank,
        etp_rank=etp_rank,
        etp_size=etp_size,
    )
    for name, p in params.items():
        p.copy_(sliced[name])
