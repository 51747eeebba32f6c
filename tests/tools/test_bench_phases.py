"""tools/bench_phases.py: the per-phase split of an SAO step on the shipped configs, run on tiny
models (the shapes of the configs' rollouts, a 2-layer 64-wide MoE)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))  # bench_phases imports bench_mfu from there
_spec = importlib.util.spec_from_file_location("bench_phases", ROOT / "tools" / "bench_phases.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

TINY = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
    "model.head_dim=32",
    "model.num_experts=4",
    "model.moe_intermediate_size=32",
    "rollout.trajectories_per_batch=4",
    "rl.micro_batch_size=4",
]


def test_windowed_config_gets_one_row_a_node(parallel_1rank):
    """hanoi_plan (window 1): one row a node, its context and its action."""
    job, _, _, _, batch = bench.build("hanoi_plan", parallel_1rank, TINY)
    nodes, n_obs, n_act = bench.SHAPES["hanoi_plan"]
    assert job.episode.context_mode == "window"
    assert batch.num_rows == 4 * nodes and batch.token_ids.shape[1] == n_obs + n_act
    assert int(batch.action_mask.sum()) == 4 * nodes * n_act


@pytest.mark.parametrize("config", ["quickstart"])
def test_phases_of_one_step_on_the_configs_rollout_shape(config, parallel_1rank, tmp_path):
    job, policy, value, step, batch = bench.build(config, parallel_1rank, TINY)
    nodes, n_obs, n_act = bench.SHAPES[config]
    assert job.episode.context_mode == "full_history"  # one row a trajectory
    assert batch.num_rows == 4 and batch.token_ids.shape[1] == nodes * (n_obs + n_act)
    assert int(batch.action_mask.sum()) == 4 * nodes * n_act
    # on-policy: the behaviour log-probs are the policy's own, so the first step's ratio is 1
    state = step.start(batch, train_version=0)
    for phase in step.algorithm.schedule:
        step.run(phase, state)
    m = step.finish(state)
    assert m["deviation/abs_one_minus_ratio_mean"] < 1e-4
    from sao_megatron.convert.spec import ConversionSpec
    from sao_megatron.trainer.runtime import job_hf_config

    spec = ConversionSpec.from_hf_config(job_hf_config(job, bench._VocabOnly(job)))
    t = bench.time_phases(step, batch, spec, parallel_1rank, tmp_path)
    k = job.algorithm.sao.value_updates_per_policy_update
    names = ["value_targets"] + [f"value_update_{i + 1}" for i in range(k)]
    names += ["advantages", "policy_update", "weight_sync", "value_pretrain_step"]
    names += ["value_pretrain_step_fit_after"]
    assert list(t) == names and all(v > 0 for v in t.values())
    assert (tmp_path / "slot1" / "model.safetensors").is_file()  # the sync wrote its slot
    med = bench.summarise([t, t])
    want = (t["value_targets"] + sum(t[f"value_update_{i + 1}"] for i in range(k))) + t[
        "advantages"
    ]
    assert math.isclose(med["value_phase"], want)
    assert math.isclose(med["value_phase_over_policy"], want / t["policy_update"])
    assert "| " + config + " |" in bench.markdown(
        {
            "machine": {
                "cpu": "cpu",
                "nproc": 2,
                "torch": torch.__version__,
                "threads": 2,
                "date_utc": "2026-12-04 22:00",
                "commit": "abc",
                "load_avg_1_5_15": "0.1 0.1 0.1",
                "loadavg_1min_end": 0.1,
            },
            "configs": {config: {"rows": 1, "seq_len": 1, "tokens": 1, "median_s": med}},
        }
    )
