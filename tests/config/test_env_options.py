"""Environment options are checked against each environment's schema when the job config loads
(issue 31.3): misspelt keys (with a did-you-mean), unknown reasoning-gym datasets, wrong types and
out-of-range values fail in `load_config`, before any model is built or any stage runs, with the
field path of the entry (``tasks.train[0].options.horizn``)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sao_megatron.configs import load_config
from sao_megatron.envs import make_env, registered_envs
from sao_megatron.envs.hanoi import HanoiConfig
from sao_megatron.trainer.job import JobConfig, TasksConfig

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "configs" / "quickstart.yaml"
HANOI_KEYS = sorted(f.name for f in dataclasses.fields(HanoiConfig))


def _load_error(*overrides: str) -> str:
    with pytest.raises(ValueError) as info:
        load_config(JobConfig, QUICKSTART, list(overrides))
    return str(info.value)


def test_misspelt_hanoi_option_names_the_path_the_keys_and_the_fix():
    msg = _load_error("tasks.train=[{name: hanoi, options: {horizn: 7}}]")
    assert msg == (
        "tasks.train[0].options.horizn: unknown option of environment 'hanoi' (not a field of "
        "HanoiConfig); did you mean 'horizon' or 'max_horizon' or 'horizon_shape'? allowed "
        f"options: {HANOI_KEYS}"
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "tasks.train=[{name: reasoning_gym, options: {dataset: chain_sun}}]",
            "tasks.train[0].options.dataset='chain_sun': not a reasoning-gym dataset; did you "
            "mean 'chain_sum' or",
        ),
        (
            "tasks.eval=[{name: chain_sum, options: {difficulty: {max_digit: 2}}}]",
            "tasks.eval[0].options.difficulty.max_digit: unknown difficulty knob of reasoning-gym "
            "dataset 'chain_sum'; did you mean 'max_digits' or 'min_digits'?",
        ),
        (
            "tasks.train=[{name: chain_sum}, {name: hanoi, options: {horizon: seven}}]",
            "tasks.train[1].options.horizon='seven': must be an integer (got str)",
        ),
        (
            "tasks.train=[{name: hanoi, options: {horizon: 0}}]",
            "tasks.train[0].options.horizon=0: must be an integer >= 1",
        ),
        (
            "tasks.train=[{name: hanoi, options: {reward_mode: dense}}]",
            "tasks.train[0].options.reward_mode='dense': use 'success' or 'progress'",
        ),
        (
            "tasks.train=[{name: hanoi, options: {goal: random}}]",
            "tasks.train[0].options.goal='random' needs tasks.train[0].options.start='random'",
        ),
        (
            "tasks.train=[{name: chain_sum, options: {dataset: basic_arithmetic}}]",
            "tasks.train[0].options.dataset: 'dataset' is fixed to 'chain_sum' by environment "
            "'chain_sum'; use the 'reasoning_gym' environment to pick a dataset",
        ),
        (
            "tasks.train=[{name: latency, options: {env: {name: hanoi, options: {horizn: 3}}}}]",
            "tasks.train[0].options.env.options.horizn: unknown option of environment 'hanoi'",
        ),
        (
            "tasks.train=[{name: latency, options: {median: 0.1}}]",
            "tasks.train[0].options.median: unknown option of environment 'latency' (not a field "
            "of LatencyOptions); did you mean 'median_s'?",
        ),
        (
            "tasks.train=[{name: latency, options: {env: {name: hanio}}}]",
            "tasks.train[0].options.env.name='hanio' is not a registered environment; did you "
            "mean 'hanoi'?",
        ),
        (
            "demonstrations.envs=[{name: hanoi}, {name: hanoi, options: {max_steps_factor: 0.5}}]",
            "demonstrations.envs[1].options.max_steps_factor=0.5: must be >= 1.0",
        ),
        (
            "tasks.train=[{name: agent, options: {task: 'm:make_task'}}]",
            "tasks.train[0].options.agent: required option of environment 'agent' is missing",
        ),
        (
            "tasks.train=[{name: agent, options: {agent: run, task: 'm:make_task'}}]",
            "tasks.train[0].options.agent='run': give 'package.module:function' or "
            "'file.py:function'",
        ),
        (
            "tasks.train=[{name: agent, options: {agent: 'm:run', task: 'm:t', max_turns: 0}}]",
            "tasks.train[0].options.max_turns=0: must be >= 1 or null",
        ),
    ],
)
def test_bad_options_fail_when_the_config_loads(override, message):
    assert _load_error(override).startswith(message)


def test_programmatic_tasks_config_names_the_entry():
    with pytest.raises(ValueError, match=r"^tasks\.eval\[0\]\.options\.horizn: unknown option"):
        TasksConfig(eval=[{"name": "hanoi", "options": {"horizn": 7}}])


def test_make_env_checks_against_the_same_schema():
    """One owner: building at run time reports what loading the config reports, under the
    environment's own name."""
    with pytest.raises(ValueError) as info:
        make_env("hanoi", horizn=7)
    assert str(info.value).startswith(
        "hanoi.horizn: unknown option of environment 'hanoi' (not a field of HanoiConfig); "
        "did you mean 'horizon' or 'max_horizon' or 'horizon_shape'? allowed options: "
    )
    with pytest.raises(ValueError, match=r"^reasoning_gym\.dataset='chain_sun'.*'chain_sum'"):
        make_env("reasoning_gym", dataset="chain_sun")


def test_every_built_in_environment_declares_its_options():
    from sao_megatron.envs.base import options_schema

    for name in registered_envs():
        assert options_schema(name) is not None, name


def test_good_configs_still_load():
    for path in sorted((ROOT / "examples" / "configs").glob("*.yaml")):
        assert isinstance(load_config(JobConfig, path), JobConfig), path


def test_sao_train_prints_the_one_line_error_before_any_stage(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "sao_megatron.cli.train", str(QUICKSTART), f"run_dir={run_dir}"]
    cmd.append("tasks.train=[{name: hanoi, options: {horizn: 7}}]")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 2, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("sao-train:")]
    assert lines == [
        "sao-train: config error: tasks.train[0].options.horizn: unknown option of environment "
        "'hanoi' (not a field of HanoiConfig); did you mean 'horizon' or 'max_horizon' or "
        f"'horizon_shape'? allowed options: {HANOI_KEYS}"
    ], p.stderr[-3000:]
    assert not run_dir.exists()  # nothing ran: no stage folder, no tokenizer, no log


DOC = ROOT / "docs" / "ENVIRONMENTS.md"
BLOCK = re.compile(r"<!-- options: (\w+) \(generated: [^)]*\) -->\n(.*?)\n<!-- /options -->", re.S)
SAME_AS = {"chain_sum": "reasoning_gym", "basic_arithmetic": "reasoning_gym"}  # dataset fixed


def test_documented_option_tables_are_generated_from_the_schemas():
    """docs/ENVIRONMENTS.md lists each environment's options as `options_table` renders its
    schema; regenerate a stale table with `python -m sao_megatron.cli.envs options NAME`."""
    from sao_megatron.envs.base import fixed_options, options_schema
    from sao_megatron.envs.options import options_table

    blocks = dict(BLOCK.findall(DOC.read_text()))
    assert sorted(blocks) == sorted(set(registered_envs()) - set(SAME_AS))
    for name, table in blocks.items():
        assert table == options_table(options_schema(name), fixed_options(name)), name
    # the shared table is the one of the environments that fix `dataset`
    for name, shown in SAME_AS.items():
        assert options_schema(name) is options_schema(shown)
        assert set(fixed_options(name)) == {"dataset"}
    hanoi = blocks["hanoi"].splitlines()
    assert hanoi[2] == (
        "| `horizon` | an integer | `50` | H, the number of optimal moves that remain at reset "
        '(>= 1); the median H when `horizon_distribution` is not "fixed". |'
    )
    assert len(hanoi) == 2 + len(HANOI_KEYS)
    assert "| `agent` | a string or a callable | required |" in blocks["agent"]


def test_an_environment_without_a_schema_is_checked_against_its_parameters():
    from sao_megatron.envs import EnvSpec, register_env
    from sao_megatron.envs.base import _REGISTRY

    @register_env("test_word")
    def make_word(word: str = "hi"):
        return word

    @register_env("test_anything")
    def make_anything(**options):
        return options

    try:
        assert EnvSpec(name="test_word", options={"word": "yo"}).build() == "yo"
        with pytest.raises(ValueError) as info:
            TasksConfig(train=[{"name": "test_word", "options": {"wrd": "yo"}}])
        assert str(info.value) == (
            "tasks.train[0].options.wrd: unknown option of environment 'test_word' (not a "
            "parameter of test_an_environment_without_a_schema_is_checked_against_its_parameters."
            "<locals>.make_word); did you mean 'word'? allowed options: ['word']"
        )
        assert EnvSpec(name="test_anything", options={"x": 1}).build() == {"x": 1}  # **kwargs
    finally:
        _REGISTRY.pop("test_word", None)
        _REGISTRY.pop("test_anything", None)
