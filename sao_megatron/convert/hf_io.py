"""HF checkpoint folders: lazy per-tensor safetensors reading, sharded writing, atomic output.

Reading never loads a whole shard: :class:`HFCheckpointReader` opens each shard with
``safetensors.safe_open`` (memory-mapped) and returns one tensor at a time. Writing keeps at most
one output shard (``max_shard_bytes``) in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Files copied verbatim next to the weights (config is rewritten, not copied).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "generation_config.json",
    "chat_template.jinja",
)


def read_hf_config(hf_dir: str | os.PathLike) -> dict[str, Any]:
    """Return ``config.json`` of an HF folder as a dict.

    Raises:
        FileNotFoundError: no ``config.json`` (names the folder).
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --hf must be an HF model folder")
    return json.loads(path.read_text())


class HFCheckpointReader:
    """Lazy reader of the safetensors weights of an HF model folder.

    Uses ``model.safetensors.index.json`` when present (checks every shard it names exists),
    else ``model.safetensors``.

    Raises (at construction):
        FileNotFoundError: no weights, or a shard named by the index is missing (lists them).
    """

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        index = self.dir / INDEX_NAME
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        elif (self.dir / SINGLE_NAME).is_file():
            with safe_open(self.dir / SINGLE_NAME, framework="pt") as f:
                weight_map = {k: SINGLE_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"{self.dir}: neither {INDEX_NAME} nor {SINGLE_NAME} found (only safetensors "
                "checkpoints are supported; convert .bin files with transformers first)"
            )
        missing = sorted({f for f in weight_map.values() if not (self.dir / f).is_file()})
        if missing:
            raise FileNotFoundError(
                f"{self.dir}: shards named in {INDEX_NAME} are missing: {missing}"
            )
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def keys(self) -> list[str]:
        """All tensor names in the checkpoint."""
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        """Read one tensor (its stored dtype, CPU).

        Raises:
            KeyError: the checkpoint has no tensor ``name``.
        """
        if name not in self.weight_map:
            raise KeyError(f"{self.dir}: checkpoint has no tensor {name!r}")
        file = self.weight_map[name]
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(
                safe_open(self.dir / file, framework="pt", device="cpu")
            )
        return self._handles[file].get_tensor(name)

    def close(self) -> None:
        """Close the open shard files."""
        self._stack.close()
        self._handles.clear()

    def __enter__(self) -> HFCheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def write_sharded_safetensors(
    tensors: Iterator[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    *,
    max_shard_bytes: int = 5 * 1024**3,
    metadata: dict[str, str] | None = None,
) -> dict[str, str]:
    """Write ``(name, tensor)`` pairs as HF-style shards plus ``model.safetensors.index.json``.

    Shards are ``model-0000i-of-0000n.safetensors`` (n known at the end: shards are written
    under temporary names and renamed). Holds at most one shard in memory.

    Args:
        tensors: names must be unique; tensors are made contiguous CPU tensors.
        out_dir: an existing (normally temporary) folder.
        max_shard_bytes: start a new shard when the next tensor would pass this size.
        metadata: safetensors header metadata (default ``{"format": "pt"}``).

    Returns:
        The index's ``weight_map`` (tensor name -> shard file name).

    Raises:
        ValueError: a duplicate tensor name, or ``max_shard_bytes <= 0``.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}: must be > 0")
    out = Path(out_dir)
    meta = {"format": "pt", **(metadata or {})}
    shards: list[list[str]] = []
    buffer: dict[str, torch.Tensor] = {}
    size = total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal buffer, size
        if buffer:
            save_file(buffer, str(out / f"shard-{len(shards):05d}.tmp"), metadata=meta)
            shards.append(list(buffer))
            buffer, size = {}, 0

    for name, tensor in tensors:
        if name in seen:
            raise ValueError(f"duplicate tensor name {name!r} in the export")
        seen.add(name)
        nbytes = tensor.numel() * tensor.element_size()
        if buffer and size + nbytes > max_shard_bytes:
            flush()
        buffer[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    flush()
    weight_map: dict[str, str] = {}
    for i, names in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        os.replace(out / f"shard-{i:05d}.tmp", out / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True))
    return weight_map


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer / generation files of :data:`TOKENIZER_FILES` that exist in ``src``.

    Returns:
        The copied file names.
    """
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def tokenizer_sha256(folder: str | os.PathLike) -> str | None:
    """SHA-256 over the tokenizer files of :data:`TOKENIZER_FILES` present (name + bytes), or
    None when there are none. Used to detect a tokenizer swapped between conversions."""
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        path = Path(folder) / name
        if path.is_file() and name != "generation_config.json":
            digest.update(name.encode() + b"\0" + path.read_bytes())
            found = True
    return digest.hexdigest() if found else None


def tokenizer_num_tokens(folder: str | os.PathLike) -> int | None:
    """Number of token ids the tokenizer in ``folder`` can emit (max id + 1), or None.

    Reads ``tokenizer.json`` (vocab + added tokens) or a sentencepiece ``tokenizer.model``.
    """
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        data = json.loads((folder / "tokenizer.json").read_text())
        vocab = data.get("model", {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t["id"] for t in data.get("added_tokens", [])]
        return max(ids) + 1 if ids else None
    if (folder / "tokenizer.model").is_file():
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(
            model_file=str(folder / "tokenizer.model")
        ).get_piece_size()
    return None


def shared_mkdtemp(parent: Path, name: str) -> Path:
    """A new temporary folder ``parent/.<name>.tmp-XXXX`` with the permissions of a plain
    ``mkdir`` (0o777 minus the umask), not mkdtemp's 0o700: it is renamed into an output folder
    that others on shared storage must be able to read."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    return tmp


@contextlib.contextmanager
def atomic_output_dir(out_dir: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling folder that becomes ``out_dir`` only if the block succeeds.

    On an exception the temporary folder is removed and ``out_dir`` is untouched, so nothing is
    ever partially written.

    Raises:
        FileExistsError: ``out_dir`` exists and is not empty and ``overwrite`` is False.
    """
    out = Path(out_dir).absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty: choose another --out or --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = shared_mkdtemp(out.parent, out.name)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
