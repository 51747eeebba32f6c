"""sao-plan's layout rules: each broken rule is one message naming the field and its fix."""

from __future__ import annotations

import pytest

from sao_megatron.cli.plan import main
from sao_megatron.configs import load_config
from sao_megatron.models.transformer_config import check_model_parallel_compat
from sao_megatron.plan import ClusterTarget, check_layout
from sao_megatron.trainer.job import JobConfig

QUICKSTART = "examples/configs/quickstart.yaml"


def _errors(overrides, nodes=1, gpus=8):
    job = load_config(JobConfig, QUICKSTART, overrides)
    return job, check_layout(job, ClusterTarget(nodes=nodes, gpus_per_node=gpus, gpu_memory_gib=80))


def test_tp2_without_sequence_parallel_on_moe_is_named_with_its_fix():
    job, errors = _errors(["parallel.tp=2"])
    assert len(errors) == 1
    assert "parallel.sequence_parallel=false with parallel.tp=2" in errors[0]
    assert "set parallel.sequence_parallel=true" in errors[0]
    with pytest.raises(ValueError, match="sequence_parallel"):  # the builder refuses it too
        check_model_parallel_compat(job.model, job.parallel)


@pytest.mark.parametrize(
    ("overrides", "gpus", "needle", "fix"),
    [
        (
            ["parallel.ep=3"],
            6,
            "model.num_experts=8 is not divisible by parallel.ep=3",
            "parallel.ep",
        ),
        (
            ["parallel.pp=3"],
            6,
            "model.num_hidden_layers=4 is not divisible by parallel.pp*parallel.virtual_pp=3",
            "change parallel.pp",
        ),
        (
            ["parallel.pp=2", "parallel.virtual_pp=4"],
            2,
            "parallel.pp*parallel.virtual_pp=8",
            "parallel.virtual_pp",
        ),
        (
            ["parallel.tp=8", "parallel.sequence_parallel=true"],
            8,
            "model.num_attention_heads=4",
            "tp",
        ),
        (
            ["parallel.tp=4", "parallel.sequence_parallel=true"],
            6,
            "the trainer world=6",
            "nodes/GPUs",
        ),
        (
            ["parallel.expert_tp=3", "parallel.ep=2"],
            6,
            "model.moe_intermediate_size=128 is not divisible by parallel.expert_tp=3",
            "expert_tp",
        ),
        (["rollout.trajectories_per_batch=4"], 8, "rollout.trajectories_per_batch=4", "at least 8"),
        (["value.placement=separate", "parallel.ep=2"], 8, "value.placement=separate", "ep=1"),
        (
            ["value.placement=separate", "policy_optim.distributed_optimizer=true"],
            8,
            "policy_optim.distributed_optimizer",
            "colocated",
        ),
        (
            ["rollout.extra_engine_args=[--tensor-parallel-size,16]"],
            8,
            "--tensor-parallel-size 16",
            "at most 8",
        ),
    ],
)
def test_each_broken_rule_names_field_and_fix(overrides, gpus, needle, fix):
    _, errors = _errors(overrides, gpus=gpus)
    hits = [e for e in errors if needle in e]
    assert hits, errors
    assert fix in hits[0], hits[0]


def test_a_fitting_layout_has_no_error_and_the_builder_agrees():
    job, errors = _errors(["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"])
    assert errors == []
    check_model_parallel_compat(job.model, job.parallel)
    assert job.parallel.data_parallel_size(8) == 4


def test_cli_exit_codes_for_layout_and_config_errors(capsys):
    assert main([QUICKSTART, "parallel.tp=2", "--nodes", "1", "--gpus-per-node", "2",
                 "--gpu-memory-gib", "80"]) == 2  # fmt: skip
    assert "set parallel.sequence_parallel=true" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main([QUICKSTART, "parallel.tpp=2", "--nodes", "1", "--gpus-per-node", "2",
              "--gpu-memory-gib", "80"])  # fmt: skip
    assert e.value.code == 2
    assert "did you mean 'parallel.tp'" in capsys.readouterr().err
