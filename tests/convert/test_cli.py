"""`sao-convert` end to end at 1 rank, value init from a converted checkpoint, and errors."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sao_megatron.convert.cli import main
from tests.convert.tiny_hf import save_hf, write_tokenizer


def _load_folder(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A Qwen2-MoE HF folder converted with the CLI: (hf_dir, megatron_dir, hf_model)."""
    from megatron.core import parallel_state as ps

    from sao_megatron.parallel import destroy_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    root = tmp_path_factory.mktemp("cli")
    hf_model = save_hf("qwen2_moe", root / "hf", shard="30KB")
    assert main(["hf-to-megatron", "--hf", str(root / "hf"), "--out", str(root / "mg")]) == 0
    return root / "hf", root / "mg", hf_model


def test_round_trip_through_cli_is_bit_exact(converted, tmp_path, no_megatron):
    hf_dir, mg_dir, hf_model = converted
    meta = json.loads((mg_dir / "sao_convert.json").read_text())
    assert meta["architecture"] == "Qwen2MoeForCausalLM" and meta["family"] == "qwen2_moe"
    assert meta["model_config"]["shared_expert_gate"] is True
    assert len(meta["tokenizer_sha256"]) == 64
    assert (mg_dir / "policy" / "metadata.json").is_file()
    assert sorted(p.name for p in (mg_dir / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    out = tmp_path / "export"
    args = ["megatron-to-hf", "--ckpt", str(mg_dir), "--out", str(out), "--max-shard-size", "40KB"]
    assert main(args) == 0
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and shards == sorted(p.name for p in out.glob("*.safetensors"))
    exported, source = _load_folder(out), hf_model.state_dict()
    assert set(exported) == set(source) == set(index["weight_map"])
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (out / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    assert _leftovers(tmp_path) == []


def test_value_model_from_converted_checkpoint(converted, parallel_1rank):
    """Converted policy -> policy model -> value trunk (init_value_from_policy), head explicit."""
    from sao_megatron.convert.checkpoint import load_converted_checkpoint, read_metadata
    from sao_megatron.models import (
        MoEModelConfig,
        build_policy,
        build_value_model,
        init_value_from_policy,
    )

    _, mg_dir, hf_model = converted
    cfg = MoEModelConfig(**read_metadata(mg_dir)["model_config"])
    (policy,) = build_policy(cfg, parallel_1rank)
    report = load_converted_checkpoint([policy], mg_dir)
    assert report.missing == [] and report.unexpected == []
    assert "decoder.layers.1.mlp.shared_experts.gate_weight" in report.loaded
    (value,) = build_value_model(cfg, parallel_1rank)
    head = {k: v.clone() for k, v in value.output_layer.state_dict().items()}
    init = init_value_from_policy(value, policy.state_dict())
    assert "output_layer.weight" in init.ignored_policy_keys and init.missing == []
    emb = value.state_dict()["embedding.word_embeddings.weight"]
    assert torch.equal(emb, hf_model.state_dict()["model.embed_tokens.weight"])
    assert value.output_layer.state_dict().keys() == head.keys()


def test_value_model_loads_converted_checkpoint_directly(converted, parallel_1rank):
    """The value head [1, h] is not the policy's output layer [vocab, h]: reported as missing,
    never partially loaded; the trunk comes from the checkpoint."""
    from sao_megatron.convert.checkpoint import load_converted_checkpoint, read_metadata
    from sao_megatron.models import MoEModelConfig, build_value_model

    _, mg_dir, hf_model = converted
    cfg = MoEModelConfig(**read_metadata(mg_dir)["model_config"])
    (value,) = build_value_model(cfg, parallel_1rank)
    head = {k: v.clone() for k, v in value.output_layer.state_dict().items()}
    with pytest.raises(
        ValueError, match=r"output_layer\.weight: model \(1, 32\), checkpoint \(96, 32\)"
    ):
        load_converted_checkpoint([value], mg_dir)
    report = load_converted_checkpoint([value], mg_dir, allow_missing=[r"^output_layer\."])
    assert report.missing == ["output_layer.bias", "output_layer.weight"]
    assert report.unexpected == []
    source = hf_model.state_dict()
    state = value.state_dict()
    assert torch.equal(
        state["embedding.word_embeddings.weight"], source["model.embed_tokens.weight"]
    )
    assert torch.equal(
        state["decoder.layers.1.mlp.shared_experts.gate_weight"],
        source["model.layers.1.mlp.shared_expert_gate.weight"],
    )
    for key, tensor in value.output_layer.state_dict().items():
        assert torch.equal(tensor, head[key]), key  # explicit init kept


def test_checkpoint_model_mismatch_is_listed(converted, parallel_1rank):
    """A tied policy has no place for the checkpoint's output layer: reported, then allowed."""
    from sao_megatron.convert.checkpoint import load_converted_checkpoint, read_metadata
    from sao_megatron.models import MoEModelConfig, build_policy

    _, mg_dir, hf_model = converted
    fields = read_metadata(mg_dir)["model_config"]
    (tied,) = build_policy(
        MoEModelConfig(**{**fields, "tie_word_embeddings": True}), parallel_1rank
    )
    with pytest.raises(ValueError, match=r"unexpected in checkpoint \['output_layer\.weight'\]"):
        load_converted_checkpoint([tied], mg_dir)
    report = load_converted_checkpoint([tied], mg_dir, allow_unexpected=[r"^output_layer\."])
    assert report.unexpected == ["output_layer.weight"] and report.missing == []
    router = tied.state_dict()["decoder.layers.0.mlp.router.weight"]
    assert torch.equal(router, hf_model.state_dict()["model.layers.0.mlp.gate.weight"])


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "hf-to-megatron" in text and "megatron-to-hf" in text
    with pytest.raises(SystemExit):
        main(["hf-to-megatron", "--help"])
    text = capsys.readouterr().out
    assert "--tp" in text and "sao-train does not load it" in text and "init_from_hf" in text


def test_a_job_starts_from_the_hf_folder_not_the_converted_one(converted):
    """hf-to-megatron output is for offline use: a job pointed at it is told to use the HF
    folder it came from; from that folder the job builds the converted checkpoint's model."""
    from sao_megatron.convert.checkpoint import read_metadata
    from sao_megatron.data.tokenizer import TokenizerConfig
    from sao_megatron.models import MoEModelConfig
    from sao_megatron.trainer.job import JobConfig

    hf_dir, mg_dir, _ = converted
    tokenizer = TokenizerConfig(kind="hf", path=str(mg_dir / "hf"))
    with pytest.raises(
        ValueError, match=r"made by `sao-convert hf-to-megatron`, which jobs do"
    ) as e:
        JobConfig(init_from_hf=str(mg_dir), tokenizer=tokenizer)
    assert str(hf_dir.absolute()) in str(e.value)
    job = JobConfig(
        init_from_hf=str(hf_dir), tokenizer=TokenizerConfig(kind="hf", path=str(hf_dir))
    )
    assert job.model == MoEModelConfig(**read_metadata(mg_dir)["model_config"])


def _expect_error(argv, pattern, capsys, out: Path) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "sao-convert: error:" in err
    assert re.search(pattern, err), err
    assert not out.exists()
    assert _leftovers(out.parent) == []


@pytest.fixture
def small_hf(tmp_path):
    save_hf("mixtral", tmp_path / "hf", shard="30KB")
    return tmp_path / "hf"


def _edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def test_unknown_architecture(small_hf, capsys, no_megatron):
    _edit_config(small_hf, architectures=["GPTNeoXForCausalLM"])
    out = small_hf.parent / "mg"
    _expect_error(
        ["hf-to-megatron", "--hf", str(small_hf), "--out", str(out)],
        r"GPTNeoXForCausalLM.*not supported",
        capsys,
        out,
    )


def test_missing_shard(small_hf, capsys, no_megatron):
    next(small_hf.glob("model-00002-*.safetensors")).unlink()
    out = small_hf.parent / "mg"
    _expect_error(
        ["hf-to-megatron", "--hf", str(small_hf), "--out", str(out)],
        r"shards named in model.safetensors.index.json are missing.*00002",
        capsys,
        out,
    )


def test_shape_mismatch_writes_nothing(small_hf, capsys, no_megatron):
    _edit_config(small_hf, intermediate_size=24)
    out = small_hf.parent / "mg"
    _expect_error(
        ["hf-to-megatron", "--hf", str(small_hf), "--out", str(out)],
        r"w1\.weight.*w3\.weight.*\(32, 32\).*linear_fc1\.weight is \(48, 32\)",
        capsys,
        out,
    )


def test_tokenizer_larger_than_vocab(small_hf, capsys, no_megatron):
    write_tokenizer(small_hf, 120)
    out = small_hf.parent / "mg"
    _expect_error(
        ["hf-to-megatron", "--hf", str(small_hf), "--out", str(out)],
        r"tokenizer .* 120 token ids but config.json vocab_size=96",
        capsys,
        out,
    )


def test_existing_output_is_kept(small_hf, capsys, no_megatron):
    out = small_hf.parent / "mg"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["hf-to-megatron", "--hf", str(small_hf), "--out", str(out)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "x"


def test_changed_tokenizer_and_non_checkpoint_are_rejected(
    converted, tmp_path, capsys, no_megatron
):
    _, mg_dir, _ = converted
    copy = tmp_path / "mg"
    shutil.copytree(mg_dir, copy)
    write_tokenizer(copy / "hf", 50)
    out = tmp_path / "export"
    _expect_error(
        ["megatron-to-hf", "--ckpt", str(copy), "--out", str(out)],
        r"tokenizer files differ",
        capsys,
        out,
    )
    _expect_error(
        ["megatron-to-hf", "--ckpt", str(tmp_path), "--out", str(out)],
        r"not a converted checkpoint",
        capsys,
        out,
    )
