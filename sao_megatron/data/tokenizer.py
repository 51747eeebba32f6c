"""Tokenizers: train an exact round-trip sentencepiece model, load HF tokenizers, and check a
checkpoint's tokenizer against the configured one.

Exact round trip. `train_sentencepiece` uses ``normalization_rule_name="identity"``,
``remove_extra_whitespaces=False``, ``add_dummy_prefix=False`` and ``byte_fallback=True``, so
``decode(encode(s)) == s`` for every string (tabs, repeated spaces, newlines, any unicode: unseen
characters become UTF-8 byte pieces; a literal "▁", sentencepiece's space symbol, is encoded as
bytes). Digits are split into single tokens by default.

Special tokens: ids 0..3 are ``<pad>``, ``<s>`` (bos), ``</s>`` (eos), ``<unk>``; then the
episode markers (`sao_megatron.data.episode`: ``<|obs|>``, ``<|act|>``, ``<|eoa|>``) as
user-defined symbols, i.e. single tokens that also match in text and decode back to themselves.

Saving beside checkpoints. `save_tokenizer(tok, dir)` writes ``tokenizer.model`` (sentencepiece)
or the HF files, plus ``sao_tokenizer.json`` = {"kind", "sha256", "vocab_size"}.
`check_tokenizer_match(dir, tok)` raises ValueError when they differ.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import sentencepiece as spm

TOKENIZER_META = "sao_tokenizer.json"
SP_MODEL_FILE = "tokenizer.model"
EPISODE_MARKERS = ["<|obs|>", "<|act|>", "<|eoa|>"]


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer to use, or how to train one.

    Fields:
        kind: "sentencepiece" (our trained model) or "hf" (a Hugging Face tokenizer directory,
            e.g. the one shipped with an HF checkpoint; needs `transformers`).
        path: a sentencepiece ``.model`` file, a directory written by `save_tokenizer`, or an HF
            tokenizer directory. None means "train one" (sentencepiece only).
        vocab_size: sentencepiece vocabulary size incl. 256 byte pieces and specials (>= 300).
        model_type: sentencepiece algorithm, "bpe" or "unigram".
        user_defined_symbols: strings kept as single tokens; must include the episode markers.
        split_digits: split numbers into single-digit tokens (helps small models with arithmetic).
        hard_vocab_limit: True: training fails unless the corpus yields exactly `vocab_size`
            pieces. False (default): `vocab_size` is an upper bound; templated task corpora have
            few distinct pieces, so the trained vocabulary may be smaller (a warning says so).
            Always size the model's embedding from `tokenizer.vocab_size`.
        num_threads: sentencepiece trainer threads.
    """

    kind: str = "sentencepiece"
    path: str | None = None
    vocab_size: int = 1024
    model_type: str = "bpe"
    user_defined_symbols: list[str] = field(default_factory=lambda: list(EPISODE_MARKERS))
    split_digits: bool = True
    hard_vocab_limit: bool = False
    num_threads: int = 2

    def __post_init__(self) -> None:
        if self.kind not in ("sentencepiece", "hf"):
            raise ValueError(f"tokenizer.kind={self.kind!r}: use 'sentencepiece' or 'hf'")
        if self.kind == "hf" and not self.path:
            raise ValueError(
                "tokenizer.path is required when tokenizer.kind='hf' (an HF directory)"
            )
        if not (isinstance(self.vocab_size, int) and self.vocab_size >= 300):
            raise ValueError(
                f"tokenizer.vocab_size={self.vocab_size!r}: must be an int >= 300 (256 byte pieces "
                "plus specials come first)"
            )
        if self.model_type not in ("bpe", "unigram"):
            raise ValueError(f"tokenizer.model_type={self.model_type!r}: use 'bpe' or 'unigram'")
        missing = [m for m in EPISODE_MARKERS if m not in self.user_defined_symbols]
        if self.kind == "sentencepiece" and missing:
            raise ValueError(
                f"tokenizer.user_defined_symbols lacks the episode markers {missing}; keep them"
            )
        if self.num_threads < 1:
            raise ValueError(f"tokenizer.num_threads={self.num_threads}: must be >= 1")


@runtime_checkable
class Tokenizer(Protocol):
    """What the episode formatter, rollout engine and trainer need from a tokenizer."""

    kind: str
    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no bos/eos added."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens like bos/eos/pad decode to "")."""
        ...

    def token_to_id(self, piece: str) -> int | None:
        """Id of a single-token piece (e.g. "<|eoa|>"), or None if it is not one token."""
        ...

    def sha256(self) -> str:
        """Fingerprint of the tokenizer's files, used to detect mismatches."""
        ...

    def save(self, directory: str) -> None:
        """Write the tokenizer files into `directory` (without the meta json)."""
        ...


class SentencePieceTokenizer:
    """A sentencepiece model (from a file or serialized bytes); implements `Tokenizer`.

    Raises ValueError if the model file does not exist.
    """

    kind = "sentencepiece"

    def __init__(self, model: str | bytes) -> None:
        if isinstance(model, str):
            if not os.path.isfile(model):
                raise ValueError(f"sentencepiece model file {model!r} does not exist")
            with open(model, "rb") as f:
                model = f.read()
        self._proto = bytes(model)
        self.sp = spm.SentencePieceProcessor(model_proto=self._proto)
        self.vocab_size = int(self.sp.get_piece_size())
        self.bos_id = _none_if_neg(self.sp.bos_id())
        self.eos_id = _none_if_neg(self.sp.eos_id())
        self.pad_id = _none_if_neg(self.sp.pad_id())
        # sentencepiece reads a literal U+2581 ("▁") in the input as its whitespace symbol, so it
        # would decode as " ". We encode it as its UTF-8 byte pieces instead (byte_fallback models),
        # which decode back to "▁": the round trip stays exact.
        meta_bytes = [self.token_to_id(f"<0x{b:02X}>") for b in "\u2581".encode()]
        self._meta_ids: list[int] | None = (
            [i for i in meta_bytes if i is not None] if None not in meta_bytes else None
        )

    def encode(self, text: str) -> list[int]:
        if "\u2581" not in text or self._meta_ids is None:
            return list(self.sp.encode(text, out_type=int))
        out: list[int] = []
        for k, part in enumerate(text.split("\u2581")):
            if k:
                out += self._meta_ids
            if part:
                out += self.sp.encode(part, out_type=int)
        return out

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def token_to_id(self, piece: str) -> int | None:
        i = self.sp.piece_to_id(piece)
        return i if self.sp.id_to_piece(i) == piece and i != self.sp.unk_id() else None

    def id_to_piece(self, i: int) -> str:
        """The sentencepiece piece of id `i` (e.g. '▁disk', '<0x0A>', '<|eoa|>')."""
        return self.sp.id_to_piece(int(i))

    def sha256(self) -> str:
        return hashlib.sha256(self._proto).hexdigest()

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, SP_MODEL_FILE), "wb") as f:
            f.write(self._proto)


class HFTokenizer:
    """A Hugging Face tokenizer directory loaded with transformers.AutoTokenizer (local files
    only); implements `Tokenizer`. encode adds no special tokens; decode keeps them and does not
    clean up spaces. Raises ValueError without `transformers` or for a missing directory."""

    kind = "hf"

    def __init__(self, directory: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ValueError(
                f"tokenizer.kind='hf' (path {directory!r}) needs the 'transformers' package: "
                "pip install transformers torch==2.13.0, or use kind='sentencepiece'"
            ) from e
        if not os.path.isdir(directory):
            raise ValueError(f"tokenizer.path={directory!r}: not an HF tokenizer directory")
        self.tok = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        self.vocab_size = len(self.tok)
        self.bos_id = self.tok.bos_token_id
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(
            [int(i) for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def token_to_id(self, piece: str) -> int | None:
        ids = self.encode(piece)
        return ids[0] if len(ids) == 1 else None

    def sha256(self) -> str:
        vocab = sorted(self.tok.get_vocab().items())
        specials = sorted(map(str, self.tok.all_special_tokens))
        return hashlib.sha256(json.dumps([vocab, specials]).encode()).hexdigest()

    def save(self, directory: str) -> None:
        self.tok.save_pretrained(directory)


def _none_if_neg(i: int) -> int | None:
    return None if i < 0 else int(i)


def train_sentencepiece(lines: Iterable[str], config: TokenizerConfig) -> SentencePieceTokenizer:
    """Train a sentencepiece model with exact round-trip settings on `lines` (in memory).

    `lines` are training sentences; text containing newlines should be split into lines first
    (newlines and tabs still encode, as byte pieces). Deterministic for the same lines/config.
    Raises ValueError if the corpus is too small for `config.vocab_size` with
    `hard_vocab_limit=True`; warns (UserWarning) when the soft limit gives a smaller vocabulary.
    """
    if config.kind != "sentencepiece":
        raise ValueError(
            f"train_sentencepiece needs tokenizer.kind='sentencepiece', got {config.kind!r}"
        )
    sentences = [s for s in lines if s]
    if not sentences:
        raise ValueError("train_sentencepiece: the corpus is empty")
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=buf,
            model_type=config.model_type,
            vocab_size=config.vocab_size,
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            add_dummy_prefix=False,
            byte_fallback=True,
            character_coverage=1.0,
            split_digits=config.split_digits,
            hard_vocab_limit=config.hard_vocab_limit,
            allow_whitespace_only_pieces=True,
            required_chars="\u2581",  # the escaped space must be a piece even if no line has one
            user_defined_symbols=list(config.user_defined_symbols),
            pad_id=0,
            bos_id=1,
            eos_id=2,
            unk_id=3,
            num_threads=config.num_threads,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            max_sentence_length=1 << 16,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ValueError(
            f"sentencepiece training failed (tokenizer.vocab_size={config.vocab_size}, "
            f"{len(sentences)} lines): {e}. Lower vocab_size or generate a larger corpus"
        ) from e
    tok = SentencePieceTokenizer(buf.getvalue())
    if tok.vocab_size < config.vocab_size:
        warnings.warn(
            f"tokenizer.vocab_size={config.vocab_size} is an upper bound (hard_vocab_limit=False): "
            f"the corpus of {len(sentences)} lines yielded {tok.vocab_size} pieces",
            stacklevel=2,
        )
    return tok


def tokenizer_fingerprint(tokenizer: Tokenizer) -> dict[str, object]:
    """{"kind", "sha256", "vocab_size"}: what `save_tokenizer` records and checks compare."""
    return {
        "kind": tokenizer.kind,
        "sha256": tokenizer.sha256(),
        "vocab_size": tokenizer.vocab_size,
    }


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
    """Write the tokenizer files and ``sao_tokenizer.json`` into `directory` (e.g. a checkpoint)."""
    os.makedirs(directory, exist_ok=True)
    tokenizer.save(directory)
    with open(os.path.join(directory, TOKENIZER_META), "w") as f:
        json.dump(tokenizer_fingerprint(tokenizer), f, indent=1)


def load_tokenizer(path: str, kind: str = "sentencepiece") -> Tokenizer:
    """Load a tokenizer from a ``.model`` file, a `save_tokenizer` directory or an HF directory.

    A directory with ``sao_tokenizer.json`` uses the kind recorded there and is checked against
    its recorded sha256 (ValueError if the files were changed). Otherwise `kind` decides.
    """
    meta_path = os.path.join(path, TOKENIZER_META)
    if os.path.isdir(path) and os.path.isfile(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        kind = meta["kind"]
        tok: Tokenizer = (
            SentencePieceTokenizer(os.path.join(path, SP_MODEL_FILE))
            if kind == "sentencepiece"
            else HFTokenizer(path)
        )
        if tok.sha256() != meta["sha256"]:
            raise ValueError(
                f"{meta_path} records sha256 {meta['sha256'][:12]}... but the tokenizer files in "
                f"{path!r} hash to {tok.sha256()[:12]}...: the files were modified"
            )
        return tok
    if kind == "hf":
        return HFTokenizer(path)
    if os.path.isdir(path):
        return SentencePieceTokenizer(os.path.join(path, SP_MODEL_FILE))
    return SentencePieceTokenizer(path)


def load_tokenizer_from_config(config: TokenizerConfig) -> Tokenizer:
    """Load `config.path` (ValueError if it is None: train one with `train_sentencepiece`)."""
    if config.path is None:
        raise ValueError(
            "tokenizer.path is None: train a tokenizer first (sao_megatron.data.demonstrations."
            "train_tokenizer_for_envs) or point tokenizer.path at a .model file / directory"
        )
    return load_tokenizer(config.path, kind=config.kind)


def check_tokenizer_match(checkpoint_dir: str, tokenizer: Tokenizer) -> None:
    """Raise ValueError unless the tokenizer recorded in `checkpoint_dir` is `tokenizer`.

    Compares kind, vocab_size and sha256 from ``sao_tokenizer.json``; a checkpoint without that
    file is also an error (we cannot prove the token ids mean the same text).
    """
    meta_path = os.path.join(checkpoint_dir, TOKENIZER_META)
    if not os.path.isfile(meta_path):
        raise ValueError(
            f"checkpoint {checkpoint_dir!r} has no {TOKENIZER_META}: save the tokenizer with "
            "sao_megatron.data.tokenizer.save_tokenizer when writing checkpoints"
        )
    with open(meta_path) as f:
        saved = json.load(f)
    mine = tokenizer_fingerprint(tokenizer)
    diffs = [k for k in ("kind", "vocab_size", "sha256") if saved.get(k) != mine[k]]
    if diffs:
        detail = ", ".join(
            f"{k}: checkpoint={saved.get(k)!r} configured={mine[k]!r}" for k in diffs
        )
        raise ValueError(
            f"tokenizer mismatch with checkpoint {checkpoint_dir!r} ({detail}). Set tokenizer.path "
            f"to {checkpoint_dir!r} to use the checkpoint's own tokenizer"
        )
