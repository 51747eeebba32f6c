from dataclasses import dataclass, field

import pytest

from sao_megatron.configs import describe, load_config, to_yaml


@dataclass(kw_only=True)
class Inner:
    lr: float = 1e-3
    steps: int = 10

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"optim.lr={self.lr}: must be > 0")


@dataclass(kw_only=True)
class Job:
    optim: Inner = field(default_factory=Inner)
    name: str = "run"


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("optim:\n  lr: 0.5\nname: x\n")
    cfg = load_config(Job, f, ["optim.steps=3"])
    assert isinstance(cfg.optim, Inner)
    assert (cfg.optim.lr, cfg.optim.steps, cfg.name) == (0.5, 3, "x")
    assert "lr: 0.5" in to_yaml(cfg)


def test_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="optim.stpes"):
        load_config(Job, None, ["optim.stpes=3"])
    with pytest.raises(ValueError, match="optim.steps"):
        load_config(Job, None, ["optim.steps=abc"])
    with pytest.raises(ValueError, match="optim.lr=-1"):
        load_config(Job, None, ["optim.lr=-1"])
    with pytest.raises(ValueError, match="section.field=value"):
        load_config(Job, None, ["optim.lr"])
    with pytest.raises(FileNotFoundError):
        load_config(Job, tmp_path / "missing.yaml")


def test_describe():
    assert describe(Job) == [("optim.lr", "0.001"), ("optim.steps", "10"), ("name", "'run'")]


def test_job_config_derived_fields_follow_overrides():
    """Fields derived in __post_init__ are derived again from the overridden values."""
    from sao_megatron.trainer.job import JobConfig

    base = load_config(JobConfig, None, [])
    assert base.algorithm.importance_weighting == "dis_band"
    cfg = load_config(
        JobConfig,
        None,
        ["algorithm.name=grpo", "stages=[sft,rl]", "parallel.tp=2", "parallel.ep=2"],
    )
    assert cfg.algorithm.importance_weighting == "none"
    assert cfg.parallel.expert_tp == 2
    # the rollout buffer takes its group size and staleness bound from the algorithm
    assert cfg.rollout.grpo_group_size == cfg.algorithm.grpo_group_size == 8
    assert cfg.rollout.max_staleness == cfg.algorithm.max_staleness


def test_job_config_cross_field_errors():
    from sao_megatron.trainer.job import JobConfig

    with pytest.raises(ValueError, match="value_pretrain"):
        load_config(JobConfig, None, ["algorithm.name=grpo"])
    with pytest.raises(ValueError, match="stages"):
        load_config(JobConfig, None, ["stages=[rl,sft]"])
    with pytest.raises(ValueError, match="tokenizer.vocab_size"):
        load_config(JobConfig, None, ["tokenizer.vocab_size=4096"])


EXAMPLES = sorted(
    (__import__("pathlib").Path(__file__).parents[2] / "examples" / "configs").glob("*.yaml")
)


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_load(path):
    from sao_megatron.trainer.job import JobConfig

    cfg = load_config(JobConfig, path)
    assert cfg.run_dir.startswith("runs/")
    assert cfg.model.head_dim in (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM CPU
    assert cfg.model.moe_intermediate_size % 32 == 0  # vLLM CPU MoE packing


def test_example_configs_exist():
    names = {p.name for p in EXAMPLES}
    assert {"quickstart.yaml", "grpo_baseline.yaml", "hanoi_long_horizon.yaml"} <= names
