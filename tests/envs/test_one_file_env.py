"""A user's environment in one file outside the package (examples/envs/guess_number.py): imported
by `sao-train --import`, its options checked when the config loads, episodes played through our
runner by a scripted policy (its bisection solver; no engine)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from sao_megatron.cli.train import main
from sao_megatron.data.demonstrations import run_demonstration
from sao_megatron.envs import SupportsGoldAction, make_env
from sao_megatron.plugins import import_plugin
from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import Generation
from sao_megatron.rollout.runner import run_episode
from tests.rollout.fakes import make_formatter

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "configs" / "quickstart.yaml")
PLUGIN = "examples/envs/guess_number.py"
TRAIN = "tasks.train=[{name: guess_number, options: {high: 16}}]"


@pytest.fixture(autouse=True)
def unregister_after():
    """Leave the process as a fresh one: the plug-in's registration would otherwise show up in
    other tests of the same session (`registered_envs()`, `show all`)."""
    yield
    import sys

    from sao_megatron.envs import base

    base._REGISTRY.pop("guess_number", None)
    base._SCHEMAS.pop("guess_number", None)
    path = (ROOT / PLUGIN).resolve()
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and Path(file).resolve() == path:
            del sys.modules[name]


def test_sao_train_imports_the_file_and_checks_its_options(capsys):
    assert main([CONFIG, "--import", PLUGIN, TRAIN, "--print-config"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["plugins"] == [PLUGIN]  # recorded: run_dir/config.yaml re-imports it
    assert cfg["tasks"]["train"] == [
        {"name": "guess_number", "options": {"high": 16}, "weight": 1.0}
    ]
    for override, message in [
        (
            "tasks.train=[{name: guess_number, options: {high: 1}}]",
            "tasks.train[0].options.high=1: must be >= 2",
        ),
        (
            "tasks.train=[{name: guess_number, options: {hihg: 8}}]",
            "tasks.train[0].options.hihg: unknown option of environment 'guess_number' (not a "
            "field of GuessNumberOptions); did you mean 'high'?",
        ),
    ]:
        with pytest.raises(SystemExit) as e:
            main([CONFIG, "--import", PLUGIN, override, "--print-config"])
        assert e.value.code == 2
        assert f"sao-train: config error: {message}" in capsys.readouterr().err


def _scripted(formatter, policy):
    async def generate(episode_id, prompt, max_tokens, seed):
        ids = formatter.action_ids(policy())
        return Generation(ids, [-0.5] * len(ids), [0] * len(ids), "stop")

    return generate


def _run(env, policy, seed, **rollout):
    formatter = make_formatter()
    cfg = RolloutConfig(**{"max_model_len": 1024, "max_tokens_per_action": 16, **rollout})
    return asyncio.run(
        run_episode(
            env=env,
            seed=seed,
            task_id=f"guess_number:{seed}",
            formatter=formatter,
            generate=_scripted(formatter, policy),
            config=cfg,
        )
    )


def test_episodes_of_the_one_file_env_run_through_the_runner():
    import_plugin(PLUGIN, "--import")
    env = make_env("guess_number", high=16)
    assert isinstance(env, SupportsGoldAction)
    for seed in range(5):  # bisection finds 1..16 in at most 5 guesses
        traj = _run(env, env.gold_action, seed)
        assert traj.status == "completed" and traj.total_reward == 1.0
        assert traj.info["success"] is True and len(traj.nodes) <= 5
        assert traj.nodes[-1].action_text == str(env.secret)
    traj = _run(env, lambda: "eight", 0)  # malformed: the episode ends, reward 0
    assert traj.terminated and traj.info["error"] == "malformed" and traj.total_reward == 0.0
    env = make_env("guess_number", high=64, max_turns=3)
    traj = _run(env, lambda: "1", 9)  # never right: the turn budget truncates it
    assert traj.status == "truncated" and len(traj.nodes) == 3
    demo = run_demonstration(make_env("guess_number"), 2)
    assert demo.observations[0] == "Find my number from 1 to 16. Reply with one number."
    assert demo.terminated and demo.total_reward == 1.0


def test_the_documented_listing_is_the_file():
    doc = (ROOT / "docs" / "ENVIRONMENTS.md").read_text()
    assert f"```python\n{(ROOT / PLUGIN).read_text().rstrip()}\n```" in doc
