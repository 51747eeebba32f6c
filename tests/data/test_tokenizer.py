import json
import os
import random

import pytest

from sao_megatron.data.demonstrations import DemonstrationConfig, corpus_lines
from sao_megatron.data.tokenizer import (
    EPISODE_MARKERS,
    TOKENIZER_META,
    SentencePieceTokenizer,
    TokenizerConfig,
    check_tokenizer_match,
    load_tokenizer,
    load_tokenizer_from_config,
    save_tokenizer,
    train_sentencepiece,
)
from sao_megatron.envs import EnvSpec

EXTRA_LINES = [
    "tab\tseparated\tvalues",
    "double  spaces   and    more",
    "  leading and trailing  ",
    "\t\tonly tabs then text",
    " ",
    "unicode: é ü ß → ∑ 日本語 🙂 Ω≈ç",
    "line one\nline two\n\nline four",
    "<|obs|>A: 3 2 1\nB:\nC:<|act|>A->C<|eoa|>",
    "\\boxed{\\frac{1}{2}} $x^2$",
    "literal \u2581 lower-one-eighth block\u2581\u2581x\u2581",
    "\u2581",
]


@pytest.fixture(scope="module")
def corpus():
    cfg = DemonstrationConfig(
        envs=[
            EnvSpec(name="hanoi", options={"horizon": 30}),
            EnvSpec(name="chain_sum"),
            EnvSpec(name="basic_arithmetic"),
            EnvSpec(name="babyai"),
        ],
        num_episodes=20,
        seed=0,
        noise_epsilon=0.1,
    )
    return corpus_lines(cfg)


@pytest.fixture(scope="module")
def tok(corpus):
    return train_sentencepiece(corpus, TokenizerConfig(vocab_size=600, hard_vocab_limit=True))


def test_round_trips_every_generated_line_exactly(tok, corpus):
    assert len(corpus) > 500
    for line in corpus + EXTRA_LINES:
        ids = tok.encode(line)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == line


def test_round_trips_random_strings(tok):
    rng = random.Random(0)
    pool = "ab Z09 \t\n\r  é日🙂\u2581<|>-\\$" + "".join(chr(c) for c in range(0x20, 0x7F))
    for _ in range(300):
        text = "".join(rng.choice(pool) for _ in range(rng.randint(0, 40)))
        assert tok.decode(tok.encode(text)) == text


def test_special_tokens_and_markers(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 600
    for k, m in enumerate(EPISODE_MARKERS):
        assert tok.token_to_id(m) == 4 + k
        assert tok.encode(m) == [4 + k]
    assert tok.token_to_id("<|nope|>") is None
    assert tok.decode([tok.bos_id, tok.eos_id, tok.pad_id]) == ""
    # digits are split: every digit its own token
    assert len(tok.encode("12345")) == 5


def test_training_is_deterministic(tok, corpus):
    again = train_sentencepiece(corpus, TokenizerConfig(vocab_size=600, hard_vocab_limit=True))
    assert again.sha256() == tok.sha256()
    unigram = train_sentencepiece(corpus, TokenizerConfig(vocab_size=380, model_type="unigram"))
    for line in corpus[:200] + EXTRA_LINES:
        assert unigram.decode(unigram.encode(line)) == line


def test_save_load_and_checkpoint_match(tok, corpus, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    save_tokenizer(tok, ckpt)
    meta = json.load(open(os.path.join(ckpt, TOKENIZER_META)))
    assert meta == {"kind": "sentencepiece", "sha256": tok.sha256(), "vocab_size": 600}
    loaded = load_tokenizer(ckpt)
    assert loaded.sha256() == tok.sha256()
    assert loaded.encode(EXTRA_LINES[5]) == tok.encode(EXTRA_LINES[5])
    assert load_tokenizer(os.path.join(ckpt, "tokenizer.model")).sha256() == tok.sha256()
    assert load_tokenizer_from_config(TokenizerConfig(path=ckpt)).sha256() == tok.sha256()
    check_tokenizer_match(ckpt, loaded)  # no error

    other = train_sentencepiece(corpus, TokenizerConfig(vocab_size=700, hard_vocab_limit=True))
    with pytest.raises(
        ValueError, match=r"tokenizer mismatch.*vocab_size: checkpoint=600 configured=700"
    ):
        check_tokenizer_match(ckpt, other)
    same_size = train_sentencepiece(corpus, TokenizerConfig(vocab_size=600, split_digits=False))
    with pytest.raises(ValueError, match=r"tokenizer mismatch.*sha256"):
        check_tokenizer_match(ckpt, same_size)
    with pytest.raises(ValueError, match="has no sao_tokenizer.json"):
        check_tokenizer_match(str(tmp_path), tok)

    # tampered files are detected on load
    other.save(ckpt)
    with pytest.raises(ValueError, match="were modified"):
        load_tokenizer(ckpt)


def test_config_errors_name_the_field(corpus):
    with pytest.raises(ValueError, match="tokenizer.vocab_size"):
        TokenizerConfig(vocab_size=100)
    with pytest.raises(ValueError, match="tokenizer.model_type"):
        TokenizerConfig(model_type="wordpiece")
    with pytest.raises(ValueError, match="tokenizer.kind"):
        TokenizerConfig(kind="tiktoken")
    with pytest.raises(ValueError, match="tokenizer.path is required"):
        TokenizerConfig(kind="hf")
    with pytest.raises(ValueError, match="episode markers"):
        TokenizerConfig(user_defined_symbols=["<|obs|>"])
    with pytest.raises(ValueError, match="tokenizer.path is None"):
        load_tokenizer_from_config(TokenizerConfig())
    with pytest.raises(ValueError, match="Lower vocab_size"):
        train_sentencepiece(
            ["tiny corpus"], TokenizerConfig(vocab_size=5000, hard_vocab_limit=True)
        )
    with pytest.warns(UserWarning, match=r"yielded 2[6-9][0-9] pieces"):
        small = train_sentencepiece(["tiny\tcorpus"] * 3, TokenizerConfig(vocab_size=5000))
    assert 256 + 7 < small.vocab_size < 300
    assert small.decode(small.encode("tiny  corpus ü")) == "tiny  corpus ü"
    with pytest.raises(ValueError, match="does not exist"):
        SentencePieceTokenizer("/nonexistent/tokenizer.model")


def test_hf_tokenizer_directory(tok, tmp_path):
    """With transformers: an HF directory loads and round-trips; without: a clear error."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="needs the 'transformers' package"):
            load_tokenizer(str(tmp_path), kind="hf")
        return
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(
        EXTRA_LINES * 5,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<|eoa|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_dir = str(tmp_path / "hf")
    PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|eoa|>").save_pretrained(hf_dir)
    hf = load_tokenizer(hf_dir, kind="hf")
    assert hf.kind == "hf" and hf.token_to_id("<|eoa|>") == hf.eos_id
    for line in EXTRA_LINES:
        assert hf.decode(hf.encode(line)) == line
    ckpt = str(tmp_path / "ckpt")
    save_tokenizer(hf, ckpt)
    assert load_tokenizer(ckpt).sha256() == hf.sha256()
    check_tokenizer_match(ckpt, hf)
    with pytest.raises(ValueError, match="kind: checkpoint='hf' configured='sentencepiece'"):
        check_tokenizer_match(ckpt, tok)
