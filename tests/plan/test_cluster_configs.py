"""The real-size example configs (examples/configs/cluster/) plan OK on the cluster they are
for, do not fit a smaller one (exit 3), and say the plan's predicted peak in their header."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from sao_megatron.cli.plan import main
from sao_megatron.configs import load_config
from sao_megatron.plan import ClusterTarget, make_plan
from sao_megatron.trainer.job import JobConfig

CLUSTER = Path("examples/configs/cluster")
TARGETS = {  # config -> (its cluster, a cluster it does not fit)
    "qwen3_30b_a3b_2x8_h100.yaml": ((2, 8, 80), (2, 8, 64)),
    "qwen3_30b_a3b_1x8_h200.yaml": ((1, 8, 141), (1, 8, 80)),
    "llama3_8b_1x8_h100.yaml": ((1, 8, 80), (1, 8, 40)),
}
# Qwen/Qwen3-30B-A3B config.json (the architecture fields)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
    "attention_bias": False, "decoder_sparse_step": 1, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "mlp_only_layers": [], "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 151936,
}  # fmt: skip


def _args(nodes, gpus, mem):
    return ["--nodes", str(nodes), "--gpus-per-node", str(gpus), "--gpu-memory-gib", str(mem)]


def test_every_cluster_config_is_listed():
    assert sorted(p.name for p in CLUSTER.glob("*.yaml")) == sorted(TARGETS)


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_plans_ok_on_its_target_and_fails_on_a_smaller_one(name, capsys):
    (fit, small) = TARGETS[name]
    config = str(CLUSTER / name)
    assert main([config, *_args(*fit), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and not plan["errors"]
    peak = max(r["total_bytes"] for r in plan["rows"]) / 1024**3
    header = (CLUSTER / name).read_text()
    stated = float(re.search(r"Predicted per-rank peak: ([\d.]+) GiB", header).group(1))
    assert stated == pytest.approx(peak, abs=0.006), f"{name}: header says {stated}, plan {peak}"
    assert f"sao-plan {config} {' '.join(_args(*fit))}" in " ".join(header.split())

    assert main([config, *_args(*small)]) == 3
    out = capsys.readouterr().out
    assert "does not fit:" in out and "GiB over its" in out


def test_qwen3_config_is_the_hf_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_30B_A3B))
    for name in ("qwen3_30b_a3b_2x8_h100.yaml", "qwen3_30b_a3b_1x8_h200.yaml"):
        hf = [f"init_from_hf={tmp_path}", "tokenizer.kind=hf", f"tokenizer.path={tmp_path}"]
        job = load_config(JobConfig, CLUSTER / name, hf)  # a field off config.json is refused
        plain = load_config(JobConfig, CLUSTER / name)
        # the file's max_position_embeddings (2048 = the job default, or 4096) is kept: an
        # explicit value, not config.json's 40960
        assert job.model == plain.model and job.model.max_position_embeddings in (2048, 4096)
        target = ClusterTarget(nodes=2, gpus_per_node=8, gpu_memory_gib=80)
        assert make_plan(job, target).num_params == pytest.approx(30.5e9, rel=0.01)
