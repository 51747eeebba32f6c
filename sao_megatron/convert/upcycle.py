"""Sparse upcycling: a dense HF Llama / Qwen2 folder -> an HF MoE folder whose output equals the
dense model's at step 0 (Komatsuzaki et al. 2022, "Sparse Upcycling", arXiv:2212.05055).

Layouts:

- ``LlamaForCausalLM`` -> ``MixtralForCausalLM``: every decoder MLP becomes ``E`` experts, each
  a copy of the dense ``gate/up/down_proj`` (Mixtral ``w1/w3/w2``), and a router
  ``block_sparse_moe.gate.weight [E, h]``.
- ``Qwen2ForCausalLM`` -> ``Qwen2MoeForCausalLM`` (Mixtral has no q/k/v biases): experts as
  above (``mlp.experts.e.*``), ``norm_topk_prob=true``, and the shared expert Qwen2-MoE always
  has, made a copy of the dense MLP with ``down_proj = 0`` and ``shared_expert_gate = 0``: it
  adds exactly 0 at step 0 and learns from there.

Why the output is the dense one. Both layouts renormalise the top-k routing weights
(transformers ``MixtralSparseMoeBlock``: ``w = softmax(router(x))``, top-k,
``w /= w.sum(-1)``; Qwen2-MoE the same with ``norm_topk_prob``), so for any router weights

    moe(x) = sum_{k in topk} w_k * expert_k(x) = (sum_k w_k) * mlp(x) = mlp(x)

because every expert is the same MLP. Equality is exact up to the float rounding of
``sum_k w_k`` and of the weighted sum (zero router and K = 2: ``0.5 y + 0.5 y = y`` exactly).

Router init. The default is ``normal(0, initializer_range)`` (seeded), like Megatron-Core's
router and its ``upcycling_utils`` (which keeps the MoE model's randomly initialised router and,
with granularity 1 and a renormalised top-k router, copies the MLP unscaled). A zero router
(``router_init="zeros"``) is also exact, but every token then ties and goes to the same K
experts (``topk`` breaks ties by index) and the router gets no gradient while the experts are
equal (``d moe / d w_k = mlp(x)`` for every k, and ``sum_k w_k = 1``), so the other experts
would never train.

The conversion streams (one HF tensor at a time, through
:class:`~sao_megatron.convert.hf_io.HFCheckpointReader`) and writes atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from sao_megatron.convert.hf_io import (
    HFCheckpointReader,
    atomic_output_dir,
    copy_tokenizer_files,
    read_hf_config,
    write_sharded_safetensors,
)
from sao_megatron.convert.spec import hf_config_compat

UPCYCLE_META = "sao_upcycle.json"
ROUTER_INITS = ("normal", "zeros")
_DENSE_TO_MOE = {
    "LlamaForCausalLM": "MixtralForCausalLM",
    "Qwen2ForCausalLM": "Qwen2MoeForCausalLM",
}
# Fields both configs share (copied when present).
_SHARED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "tie_word_embeddings",
    "rope_theta",
    "attention_dropout",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "torch_dtype",
    "dtype",
)


def moe_config(dense: dict[str, Any], num_experts: int, top_k: int) -> dict[str, Any]:
    """The MoE ``config.json`` for a dense one (see module docstring for the layouts).

    Raises:
        ValueError: another architecture, biases Mixtral cannot hold (Llama ``attention_bias``,
            ``mlp_bias``), ``rope_scaling``, sliding windows, or ``top_k`` not in
            ``[1, num_experts]``.
    """
    dense = hf_config_compat(dense)  # transformers-5 rope_parameters -> rope_theta
    archs = dense.get("architectures") or []
    if len(archs) != 1 or archs[0] not in _DENSE_TO_MOE:
        raise ValueError(
            f"config.json architectures={archs!r}: upcycling supports {sorted(_DENSE_TO_MOE)}"
        )
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(
            f"--num-experts={num_experts} --top-k={top_k}: need num_experts >= 1 and "
            "1 <= top_k <= num_experts"
        )
    for key in ("mlp_bias", "attention_bias", "use_sliding_window"):
        if dense.get(key):
            raise ValueError(f"config.json {key}=true: not supported by the upcycled layout")
    if dense.get("rope_scaling"):
        raise ValueError("config.json rope_scaling is set: the MoE configs here take none")
    out = {k: dense[k] for k in _SHARED_FIELDS if k in dense}
    ffn = int(dense["intermediate_size"])
    out["architectures"] = [_DENSE_TO_MOE[archs[0]]]
    out["num_experts_per_tok"] = top_k
    out["output_router_logits"] = False
    out["router_aux_loss_coef"] = 0.0
    if archs[0] == "LlamaForCausalLM":
        out.update(
            model_type="mixtral",
            intermediate_size=ffn,
            num_local_experts=num_experts,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    else:
        out.update(
            model_type="qwen2_moe",
            intermediate_size=ffn,
            moe_intermediate_size=ffn,
            shared_expert_intermediate_size=ffn,
            num_experts=num_experts,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            qkv_bias=True,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=int(dense.get("max_window_layers", dense["num_hidden_layers"])),
        )
    return out


def upcycled_tensors(
    reader: HFCheckpointReader,
    config: dict[str, Any],
    *,
    router_init: str = "normal",
    seed: int = 0,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the MoE folder's ``(name, tensor)`` pairs from a dense checkpoint, one at a time.

    Args:
        reader: the dense checkpoint.
        config: the MoE config (:func:`moe_config`).
        router_init: ``"normal"`` (``N(0, initializer_range)``, a generator seeded with
            ``seed + layer``) or ``"zeros"``.

    Yields:
        Dense tensors unchanged, and per layer: the router ``[E, h]`` (dtype of the MLP), ``E``
        copies of each MLP projection, and (Qwen2-MoE) the shared expert and its gate.
    """
    if router_init not in ROUTER_INITS:
        raise ValueError(f"router_init={router_init!r}: use one of {ROUTER_INITS}")
    mixtral = config["model_type"] == "mixtral"
    num_experts = int(config["num_local_experts" if mixtral else "num_experts"])
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    std = float(config.get("initializer_range", 0.02))
    for name in reader.keys():
        parts = name.split(".")
        if not (len(parts) == 6 and parts[0] == "model" and parts[3] == "mlp"):
            yield name, reader.get(name)
            continue
        layer, proj = int(parts[2]), parts[4]
        prefix = f"model.layers.{layer}." + ("block_sparse_moe" if mixtral else "mlp")
        weight = reader.get(name)
        if proj == "gate_proj":  # once per layer
            router = torch.zeros(num_experts, weight.shape[1], dtype=weight.dtype)
            if router_init == "normal":
                gen = torch.Generator().manual_seed(seed + layer)
                router = torch.randn(router.shape, generator=gen, dtype=torch.float32) * std
            yield f"{prefix}.gate.weight", router.to(weight.dtype)
            if not mixtral:
                yield f"{prefix}.shared_expert_gate.weight", torch.zeros_like(weight[:1])
        for e in range(num_experts):
            expert = names[proj] if mixtral else proj
            yield f"{prefix}.experts.{e}.{expert}.weight", weight.clone()
        if not mixtral:
            shared = torch.zeros_like(weight) if proj == "down_proj" else weight
            yield f"{prefix}.shared_expert.{proj}.weight", shared


def upcycle(
    dense_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    num_experts: int,
    top_k: int,
    router_init: str = "normal",
    seed: int = 0,
    overwrite: bool = False,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Write the upcycled MoE HF folder of a dense HF folder (atomic; see module docstring).

    ``OUT`` holds safetensors shards + index, ``config.json``, the tokenizer/generation files of
    the dense folder and ``sao_upcycle.json`` (source, experts, top-k, router init, seed).

    Raises:
        ValueError: see :func:`moe_config`; a dense checkpoint without the expected MLP tensors.
        FileExistsError: ``out_dir`` is not empty and ``overwrite`` is False.
    """
    dense = read_hf_config(dense_dir)
    config = moe_config(dense, num_experts, top_k)
    with HFCheckpointReader(dense_dir) as reader:
        mlp = [k for k in reader.keys() if ".mlp.gate_proj." in k]
        if len(mlp) != int(dense["num_hidden_layers"]):
            raise ValueError(
                f"{dense_dir}: {len(mlp)} mlp.gate_proj tensors for "
                f"num_hidden_layers={dense['num_hidden_layers']}: not a dense Llama/Qwen2 folder"
            )
        with atomic_output_dir(out_dir, overwrite=overwrite) as tmp:
            write_sharded_safetensors(
                upcycled_tensors(reader, config, router_init=router_init, seed=seed),
                tmp,
                max_shard_bytes=max_shard_bytes,
            )
            (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            copy_tokenizer_files(dense_dir, tmp)
            meta = {
                "source": str(Path(dense_dir).absolute()),
                "source_architecture": dense["architectures"][0],
                "num_experts": num_experts,
                "top_k": top_k,
                "router_init": router_init,
                "seed": seed,
            }
            (tmp / UPCYCLE_META).write_text(json.dumps(meta, indent=2))
    return Path(out_dir).absolute()
