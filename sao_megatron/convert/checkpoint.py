"""HF folder <-> sao_megatron Megatron checkpoint (dist_checkpointing), both atomic.

A converted Megatron checkpoint folder::

    OUT/
      sao_convert.json   metadata: format version, architecture, family, model config,
                         conversion spec, source HF config, tokenizer SHA-256, dtype
      hf/                config.json + tokenizer / generation files of the source model
      policy/            Megatron dist_checkpointing (torch_dist) save of the policy's
                         sharded_state_dict(): loads into any TP/PP/EP layout

``policy/`` is the same format as a part of a trainer checkpoint (sao_megatron.trainer.checkpoint),
so the trainer loads it with ``dist_checkpointing.load(model.sharded_state_dict(), OUT/policy)``
or :func:`load_converted_checkpoint` (which also serves the value model: trunk loaded, head kept
from its explicit init, missing/unexpected keys reported).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from sao_megatron.convert.hf_io import (
    HFCheckpointReader,
    copy_tokenizer_files,
    read_hf_config,
    shared_mkdtemp,
    tokenizer_num_tokens,
    tokenizer_sha256,
    write_sharded_safetensors,
)
from sao_megatron.convert.model_config import model_config_from_hf
from sao_megatron.convert.model_io import load_hf_into_model, megatron_to_hf_tensors
from sao_megatron.convert.spec import ConversionSpec

METADATA_NAME = "sao_convert.json"
POLICY_DIR = "policy"
HF_ASSETS_DIR = "hf"
FORMAT_VERSION = 1
_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_HF_TO_PRECISION = {v: k for k, v in _DTYPE_NAMES.items()}


def check_tokenizer_vocab(hf_dir: str | os.PathLike, vocab_size: int) -> None:
    """Check the tokenizer in ``hf_dir`` (if any) emits only ids < ``vocab_size``.

    Raises:
        ValueError: the tokenizer has more token ids than the model's embedding rows.
    """
    num_tokens = tokenizer_num_tokens(hf_dir)
    if num_tokens is not None and num_tokens > vocab_size:
        raise ValueError(
            f"tokenizer in {hf_dir} has {num_tokens} token ids but config.json vocab_size="
            f"{vocab_size}: the tokenizer does not belong to these weights"
        )


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _from_rank0(obj: Any) -> Any:
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def _all_ok(ok: bool) -> bool:
    """True on every rank iff ``ok`` on every rank (so ranks fail together, never hang)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if ok else 1])
        dist.all_reduce(flag)
        return int(flag.item()) == 0
    return ok


def _sharded_state_dict(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for chunk in chunks:
        merged.update(chunk.sharded_state_dict())
    return merged


def convert_hf_to_megatron(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    state: Any,
    *,
    params_dtype: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Convert an HF safetensors checkpoint into a Megatron dist_checkpointing folder.

    Every rank of the trainer-style world (``state`` from
    ``sao_megatron.parallel.initialize_parallel``) builds its shard of the policy, reads only its
    own HF tensors one at a time (:func:`load_hf_into_model`), and writes its shard; rank 0 adds
    the metadata and the HF config/tokenizer, then renames the temporary folder to ``out_dir``.

    Args:
        hf_dir: HF model folder (``config.json`` + safetensors, optional tokenizer files).
        out_dir: folder to create (see module docstring for its layout).
        state: ``ParallelState`` of this rank (any TP/PP/EP layout; the saved checkpoint loads
            into any other).
        params_dtype: ``"fp32"``, ``"bf16"`` or ``"fp16"``; default: config.json ``torch_dtype``
            (fp32 when absent).
        overwrite: replace a non-empty ``out_dir``.

    Returns:
        ``out_dir`` as an absolute path.

    Raises:
        ValueError: unknown architecture, unsupported feature, shape or vocab/tokenizer mismatch.
        FileNotFoundError: no config.json / weights, or missing shards.
        FileExistsError: ``out_dir`` not empty and ``overwrite`` False.
        Nothing is left at ``out_dir`` (or its previous content is kept) on any error.
    """
    from sao_megatron.models.builders import build_policy
    from sao_megatron.optim.config import PrecisionConfig

    hf_dir, out = Path(hf_dir), Path(out_dir).absolute()
    hf_config = read_hf_config(hf_dir)
    spec = ConversionSpec.from_hf_config(hf_config)
    check_tokenizer_vocab(hf_dir, spec.vocab_size)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out or --overwrite")
    hf_dtype = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
    params_dtype = params_dtype or _HF_TO_PRECISION.get(str(hf_dtype), "fp32")
    model_cfg = model_config_from_hf(hf_config)
    precision = PrecisionConfig(params_dtype=params_dtype)
    tmp = None
    if _rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = str(shared_mkdtemp(out.parent, out.name))
    tmp = Path(_from_rank0(tmp))
    error: BaseException | None = None
    try:
        with HFCheckpointReader(hf_dir) as reader:
            chunks = build_policy(model_cfg, state, precision)
            for chunk in chunks:
                load_hf_into_model(chunk, reader, spec)
    except BaseException as exc:  # noqa: BLE001 - re-raised below after the ranks agree
        error = exc
    if not _all_ok(error is None):
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise error or RuntimeError("hf-to-megatron failed on another rank; see its log")
    try:
        _save_converted(chunks, tmp, out, hf_dir, hf_config, spec, model_cfg, params_dtype, state)
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dist.is_initialized():
        dist.barrier()
    return out


def _save_converted(chunks, tmp, out, hf_dir, hf_config, spec, model_cfg, params_dtype, state):
    """Write policy/ (all ranks), then hf/ + metadata and the final rename (rank 0)."""
    from megatron.core import dist_checkpointing

    if _rank() == 0:
        (tmp / POLICY_DIR).mkdir()
    if dist.is_initialized():
        dist.barrier()
    dist_checkpointing.save(
        _sharded_state_dict(chunks), str(tmp / POLICY_DIR), sharded_strategy=("torch_dist", 1)
    )
    if _rank() == 0:
        assets = tmp / HF_ASSETS_DIR
        assets.mkdir()
        (assets / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        copy_tokenizer_files(hf_dir, assets)
        metadata = {
            "format_version": FORMAT_VERSION,
            "architecture": spec.architecture,
            "family": spec.family,
            "params_dtype": params_dtype,
            "model_config": dataclasses.asdict(model_cfg),
            "conversion_spec": spec.to_dict(),
            "tokenizer_sha256": tokenizer_sha256(assets),
            "source": str(hf_dir.absolute()),
            "layout": {"tp": state.cfg.tp, "pp": state.cfg.pp, "ep": state.cfg.ep},
        }
        (tmp / METADATA_NAME).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)


def read_metadata(ckpt_dir: str | os.PathLike) -> dict[str, Any]:
    """Read and check ``sao_convert.json`` of a converted checkpoint.

    Raises:
        FileNotFoundError: not a converted checkpoint (no metadata or no ``policy/``).
        ValueError: unsupported format version, or the tokenizer files in ``hf/`` changed since
            conversion (SHA-256 mismatch).
    """
    ckpt = Path(ckpt_dir)
    path = ckpt / METADATA_NAME
    if not path.is_file() or not (ckpt / POLICY_DIR / "metadata.json").is_file():
        raise FileNotFoundError(
            f"{ckpt} is not a converted checkpoint (needs {METADATA_NAME} and "
            f"{POLICY_DIR}/metadata.json); create it with `sao-convert hf-to-megatron` (a "
            "training run's step checkpoints are another format: a job exports its policy as "
            "HF itself, run_dir/hf_policy_final)"
        )
    meta = json.loads(path.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version={meta.get('format_version')}: expected 1")
    found = tokenizer_sha256(ckpt / HF_ASSETS_DIR)
    if found != meta.get("tokenizer_sha256"):
        raise ValueError(
            f"{ckpt / HF_ASSETS_DIR}: tokenizer files differ from the ones converted with the "
            f"weights (sha256 {found} != {meta.get('tokenizer_sha256')}); restore them"
        )
    return meta


@dataclass
class LoadReport:
    """Keys of a :func:`load_converted_checkpoint` call (Megatron sharded keys)."""

    loaded: list[str]
    """Model keys filled from the checkpoint."""
    missing: list[str]
    """Model keys the checkpoint lacks (kept at their initial values)."""
    unexpected: list[str]
    """Checkpoint keys the model has no place for (not read)."""


def load_converted_checkpoint(
    chunks: Sequence[torch.nn.Module],
    ckpt_dir: str | os.PathLike,
    *,
    allow_missing: Sequence[str] = (),
    allow_unexpected: Sequence[str] = (),
) -> LoadReport:
    """Load a converted policy checkpoint into model chunks of any layout (policy or value).

    For a value model (``build_value_model``) pass ``allow_missing=[r"^output_layer\\."]``: its
    scalar head (``output_layer.weight [1, h]``, ``output_layer.bias``) has no counterpart in a
    policy checkpoint (whose ``output_layer.weight`` is ``[vocab, h]``) and keeps its explicit
    init. Keys whose global shape differs from the checkpoint's count as missing: they are never
    loaded partially.

    Args:
        chunks: the model chunks of this rank (``build_policy`` / ``build_value_model`` output).
        ckpt_dir: a converted checkpoint folder (or its ``policy/`` subfolder).
        allow_missing: regexes (``re.search``) of model keys the checkpoint may lack (or hold
            with another shape).
        allow_unexpected: regexes of checkpoint keys the model may have no place for.

    Returns:
        A :class:`LoadReport` (sharded keys, as in the checkpoint).

    Raises:
        ValueError: a missing, reshaped or unexpected key not allowed by the patterns (lists
            them); nothing is loaded then.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    ckpt = Path(ckpt_dir)
    if (ckpt / POLICY_DIR).is_dir():
        ckpt = ckpt / POLICY_DIR
    sharded = _sharded_state_dict(chunks)
    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    # Checkpoint keys are the ShardedTensor keys (Megatron maps local-spec names to TE-style
    # ones, e.g. input_layernorm -> linear_qkv.layer_norm_weight), not the state-dict keys.
    by_key: dict[str, list[str]] = {}
    shape_problems: dict[str, str] = {}
    for name, value in sharded.items():
        if type(value).__name__ in ("ShardedTensor", "ShardedTensorFactory"):
            by_key.setdefault(value.key, []).append(name)
            shape = getattr(value, "global_shape", None)  # factories (SwiGLU experts): no shape
            if shape is not None and value.key in meta and meta[value.key].global_shape != shape:
                shape_problems[value.key] = (
                    f"{value.key}: model {tuple(shape)}, checkpoint "
                    f"{tuple(meta[value.key].global_shape)}"
                )
    missing = sorted(k for k in by_key if k not in meta or k in shape_problems)
    # Other pipeline stages / expert ranks hold the rest: unexpected = in no rank's model.
    all_keys = set(by_key)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(by_key))
        all_keys = set().union(*gathered)
    unexpected = sorted(k for k in meta if k not in all_keys)
    bad_missing = [
        shape_problems.get(k, k) for k in missing if not any(re.search(p, k) for p in allow_missing)
    ]
    bad_unexpected = [k for k in unexpected if not any(re.search(p, k) for p in allow_unexpected)]
    if not _all_ok(not (bad_missing or bad_unexpected)):
        raise ValueError(
            f"checkpoint {ckpt} does not fit the model: missing in checkpoint (or another "
            f"shape) {bad_missing[:10]} ({len(bad_missing)}), unexpected in checkpoint "
            f"{bad_unexpected[:10]} ({len(bad_unexpected)}) on this rank. Nothing was loaded."
        )
    skipped = {name for key in missing for name in by_key[key]}
    for name in skipped:
        sharded.pop(name)
    loaded = dist_checkpointing.load(sharded, str(ckpt), strict=StrictHandling.ASSUME_OK_UNEXPECTED)
    for chunk in chunks:
        own = {k: v for k, v in loaded.items() if k in chunk.state_dict()}
        result = chunk.load_state_dict(own, strict=False)
        stray = [
            k for k in result.missing_keys if k not in skipped and not k.endswith("_extra_state")
        ]
        if stray:
            raise ValueError(f"keys not restored from {ckpt}: {stray[:10]}")
    loaded_keys = sorted(k for k in by_key if k not in missing)
    return LoadReport(loaded=loaded_keys, missing=missing, unexpected=unexpected)


def convert_megatron_to_hf(
    ckpt_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    overwrite: bool = False,
    state: Any = None,
) -> Path:
    """Export a converted (or trained, same layout) Megatron checkpoint to an HF folder.

    Runs in one process: builds the policy at TP=PP=EP=1 (dist_checkpointing reshards on load),
    streams HF tensors through :func:`megatron_to_hf_tensors` into shards with an index, writes
    ``config.json`` (dtype updated) and the tokenizer files. Output is atomic.

    Args:
        state: a 1-rank ``ParallelState`` to reuse; default: ``initialize_parallel`` a 1-rank
            world here.

    Raises:
        FileNotFoundError, ValueError: see :func:`read_metadata`, :func:`load_converted_checkpoint`.
        FileExistsError: ``out_dir`` not empty and ``overwrite`` False.
    """
    from sao_megatron.models.config import MoEModelConfig
    from sao_megatron.parallel import ParallelConfig, destroy_parallel, initialize_parallel

    ckpt = Path(ckpt_dir)
    meta = read_metadata(ckpt)
    spec = ConversionSpec(**meta["conversion_spec"])
    model_cfg = MoEModelConfig(**meta["model_config"])
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out or --overwrite")
    owns_state = state is None
    if owns_state:
        state = initialize_parallel(ParallelConfig())
    try:
        _export(ckpt, out, meta, spec, model_cfg, state, max_shard_bytes, overwrite)
    finally:
        if owns_state:
            destroy_parallel()
    return out.absolute()


def _export(ckpt, out, meta, spec, model_cfg, state, max_shard_bytes, overwrite) -> None:
    """Body of :func:`convert_megatron_to_hf` once the 1-rank world exists."""
    from sao_megatron.convert.hf_io import atomic_output_dir
    from sao_megatron.models.builders import build_policy
    from sao_megatron.optim.config import PrecisionConfig

    if state.world_size != 1:
        raise ValueError(
            f"megatron-to-hf runs in one process (world size {state.world_size}); run it without "
            "torchrun - dist_checkpointing reshards any saved layout to TP=PP=EP=1"
        )
    (model,) = build_policy(model_cfg, state, PrecisionConfig(params_dtype=meta["params_dtype"]))
    load_converted_checkpoint([model], ckpt)
    hf_config = json.loads((ckpt / HF_ASSETS_DIR / "config.json").read_text())
    hf_config["torch_dtype"] = _DTYPE_NAMES[meta["params_dtype"]]
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        write_sharded_safetensors(
            megatron_to_hf_tensors(model, spec), tmp, max_shard_bytes=max_shard_bytes
        )
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        copy_tokenizer_files(ckpt / HF_ASSETS_DIR, tmp)
