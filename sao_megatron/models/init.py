"""Layout-independent weight initialisation for CPU runs (same seed -> same model in any layout).

Megatron-Core 0.16.1 with ``use_cpu_initialization=True`` draws every weight from the process's
CPU generator (tensor_parallel/layers.py ``_initialize_affine_weight_cpu``). That is TP-consistent
(the full matrix is drawn, then sliced) but not EP/PP-consistent: every EP rank draws its local
experts from the same generator state, so global experts e and e + num_experts/ep start
identical (a silent symmetry for from-scratch MoE training), and later pipeline stages do not
see the generator advanced by earlier ones. On GPU Megatron forks per-EP/TP RNG streams and this
module is not used.

Here each parameter's *full* tensor is drawn from a generator seeded by (seed, global parameter
name) with Megatron's default init, then sliced to this rank by the shard map
(``sao_megatron.parallel.sharding``):

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

from sao_megatron.models.value_head import ValueHead
from sao_megatron.parallel.sharding import full_shape, shard_map, slice_coords, split_tensor

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
    model initialised with the same ``seed`` (coordinates as in
    ``sao_megatron.parallel.sharding.shard_state_dict``; the EP offset comes from the chunk's own
    experts, ``ep_rank`` is kept for that signature)."""
    value_head = isinstance(getattr(chunk, "output_layer", None), ValueHead)
    for shard in shard_map(chunk):
        if not shard.is_param or (value_head and shard.global_name.startswith("output_layer.")):
            continue
        rank, size = slice_coords(shard, tp_rank, tp_size, etp_rank, etp_size)
        param = shard.value
        full = full_init_tensor(
            shard.global_name, full_shape(shard, size), param.dtype, seed, config
        )
        param.copy_(split_tensor(full, shard, rank, size))
