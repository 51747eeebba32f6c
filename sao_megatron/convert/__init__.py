"""HF <-> Megatron checkpoint conversion (also the weight-sync mapping to rollout engines).

Light imports only (no Megatron): the checkpoint-level functions live in
``sao_megatron.convert.checkpoint`` and the CLI in ``sao_megatron.convert.cli``.
"""

from sao_megatron.convert.families import FAMILIES, family_for_architecture
from sao_megatron.convert.hf_io import (
    HFCheckpointReader,
    atomic_output_dir,
    read_hf_config,
    write_sharded_safetensors,
)
from sao_megatron.convert.model_io import load_hf_into_model, megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec

__all__ = [
    "FAMILIES",
    "ConversionSpec",
    "HFCheckpointReader",
    "atomic_output_dir",
    "family_for_architecture",
    "load_hf_into_model",
    "megatron_to_hf_tensors",
    "read_hf_config",
    "write_sharded_safetensors",
]
