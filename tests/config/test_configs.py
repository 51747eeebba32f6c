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
    assert base.algorithm.importance.weighting == "ppo_clip"
    cfg = load_config(
        JobConfig,
        None,
        ["algorithm.name=grpo", "stages=[sft,rl]", "parallel.tp=2", "parallel.ep=2"],
    )
    assert cfg.algorithm.importance.weighting == "none"
    assert cfg.parallel.expert_tp == 2
    dis = load_config(JobConfig, None, ["algorithm.name=grpo_dis", "stages=[rl]"])
    assert dis.algorithm.importance.weighting == "dis_band"


def test_staleness_and_group_size_have_one_home_each():
    """Staleness is the rollout's (rollout.max_staleness), the group size the algorithm's
    (algorithm.grpo.group_size); neither exists in the other section, nothing is copied."""
    from sao_megatron.algorithm import registry
    from sao_megatron.trainer.job import JobConfig

    cfg = load_config(
        JobConfig,
        None,
        [
            "algorithm.name=grpo",
            "stages=[rl]",
            "algorithm.grpo.group_size=4",
            "rollout.max_staleness=0",
        ],
    )
    assert cfg.rollout.max_staleness == 0 and registry.build(cfg.algorithm).group_size == 4
    assert not hasattr(cfg.rollout, "grpo_group_size") and not hasattr(
        cfg.algorithm, "max_staleness"
    )
    for key in (
        "rollout.grpo_group_size=4",
        "algorithm.max_staleness=0",
        "rollout.model_path=x",
        "rollout.run_dir=x",
        "logging.run_dir=x",
        "algorithm.kl_coef=0.1",
    ):
        with pytest.raises(ValueError, match=key.split("=")[0].replace(".", r"\.")):
            load_config(JobConfig, None, [key])
    with pytest.raises(
        ValueError, match=r"trajectories_per_batch=16 is not a multiple of the group size 3"
    ):
        load_config(
            JobConfig, None, ["algorithm.name=grpo", "stages=[rl]", "algorithm.grpo.group_size=3"]
        )


def test_a_key_the_algorithm_ignores_is_an_error():
    from sao_megatron.trainer.job import JobConfig

    with pytest.raises(
        ValueError, match=r"algorithm\.grpo\.group_size=4 is ignored by algorithm.name='sao'"
    ):
        load_config(JobConfig, None, ["algorithm.grpo.group_size=4"])
    with pytest.raises(ValueError, match=r"algorithm\.sao\.gamma=0\.9 is ignored"):
        load_config(
            JobConfig, None, ["algorithm.name=grpo", "stages=[rl]", "algorithm.sao.gamma=0.9"]
        )


@pytest.mark.parametrize(
    "old,new",
    [
        ("algorithm.eps_low", "moved to algorithm.importance.eps_low"),
        ("algorithm.importance_weighting", "moved to algorithm.importance.weighting"),
        ("algorithm.grpo_group_size", "moved to algorithm.grpo.group_size"),
        (
            "algorithm.value_updates_per_policy_update",
            "moved to algorithm.sao.value_updates_per_policy_update",
        ),
        ("algorithm.clip_high", "moved to algorithm.ppo.clip_high"),
        ("algorithm.max_staleness", "moved to rollout.max_staleness"),
        ("rollout.grpo_group_size", "moved to algorithm.grpo.group_size"),
        ("algorithm.kl_coef", "was removed: the trainer builds no reference model"),
        ("rollout.model_path", "was removed: "),
        ("logging.run_dir", "was removed: "),
    ],
)
def test_moved_keys_have_a_migration_message(old, new):
    from sao_megatron.trainer.job import JobConfig

    with pytest.raises(ValueError) as err:
        load_config(JobConfig, None, [f"{old}=1"])
    assert str(err.value).startswith(f"config key {old!r} {new}"), err.value


def test_unknown_keys_have_no_migration_message():
    from sao_megatron.trainer.job import JobConfig

    for key in ("algorithm.bogus", "algorithm.sao.bogus", "rollout.max_stalenes"):
        with pytest.raises(ValueError, match="unknown config key") as err:
            load_config(JobConfig, None, [f"{key}=1"])
        assert "moved" not in str(err.value) and "removed" not in str(err.value), err.value


def test_job_config_cross_field_errors():
    from sao_megatron.trainer.job import JobConfig

    for name in ("grpo", "grpo_dis"):
        with pytest.raises(ValueError, match=f"value_pretrain.*algorithm.name='{name}' has no"):
            load_config(JobConfig, None, [f"algorithm.name={name}"])
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


@pytest.mark.parametrize(
    "key,fix",
    [
        ("algorithm.eps_low=0.2", "moved to algorithm.importance.eps_low"),
        ("algorithm.max_staleness=0", "moved to rollout.max_staleness"),
        ("rollout.grpo_group_size=4", "moved to algorithm.grpo.group_size"),
        ("algorithm.kl_coef=0.1", "was removed"),
        ("logging.run_dir=x", "was removed"),
    ],
)
def test_load_config_answers_a_moved_key_with_its_migration(key, fix):
    from sao_megatron.trainer.job import JobConfig

    old = key.split("=")[0]
    with pytest.raises(ValueError, match=f"config key '{old}' {fix}"):
        load_config(JobConfig, None, [key])
