"""Where an environment name comes from besides the built-ins: an installed package's entry point
(group ``sao_megatron.envs``) imported on the name's first use, the ``agent`` environment the
rollout gateway registers (imported by its import path, so ``sao_megatron.envs`` imports no
``rollout``), and each environment's own evaluation metrics (`episode_metrics`).

Import-path plug-ins (``plugins:`` / ``--import``) are tested in tests/envs/test_one_file_env.py.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from sao_megatron.cli.envs import main as envs_main
from sao_megatron.configs import load_config
from sao_megatron.envs import EnvSpec, base, episode_metrics, make_env, registered_envs
from sao_megatron.trainer.job import JobConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "configs" / "quickstart.yaml")

PACKAGE = textwrap.dedent(
    '''
    """An installed package's environment: count down from n, one "tick" per step."""
    from dataclasses import dataclass
    from typing import ClassVar

    from sao_megatron.envs import StepResult, options_config, register_env


    @dataclass(kw_only=True)
    class CountdownOptions:
        """Fields:
            n: ticks to the end (>= 1).
        """

        CONFIG_SECTION: ClassVar[str] = "ep_countdown"
        n: int = 2

        def __post_init__(self):
            if self.n < 1:
                raise ValueError(f"ep_countdown.n={self.n}: must be >= 1")


    @register_env("ep_countdown", options=CountdownOptions)
    class Countdown:
        name = "ep_countdown"

        def __init__(self, **options):
            self.config = options_config("ep_countdown", options)
            self.max_steps = self.config.n + 1

        def reset(self, seed):
            self.left = self.config.n
            return f"{self.left} left"

        def step(self, action):
            if action.strip() != "tick":
                return StepResult(observation="", reward=0.0, done=True, info={"ticks": 0})
            self.left -= 1
            done = self.left == 0
            info = {"ticks": self.config.n - self.left} if done else {}
            return StepResult(observation=f"{self.left} left", reward=float(done), done=done,
                              info=info)

        @staticmethod
        def episode_metrics(infos, options):
            return {"mean_ticks": sum(i.get("ticks", 0) for i in infos) / max(len(infos), 1),
                    "n": options.get("n", 2)}
    '''
)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package `ep_envs_pkg` installed on sys.path with a dist-info whose entry points declare
    `ep_countdown` (its module registers it) and `ep_silent` (its module registers nothing);
    the registry and sys.modules are left as a fresh process has them."""
    pkg = tmp_path / "ep_envs_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(PACKAGE)
    (pkg / "silent.py").write_text("X = 1\n")
    info = tmp_path / "ep_envs_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-envs-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        "[sao_megatron.envs]\nep_countdown = ep_envs_pkg\nep_silent = ep_envs_pkg.silent\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("ep_countdown", "ep_silent"):
        base._REGISTRY.pop(name, None)
        base._SCHEMAS.pop(name, None)
    for name in [m for m in sys.modules if m == "ep_envs_pkg" or m.startswith("ep_envs_pkg.")]:
        del sys.modules[name]


def test_an_entry_point_environment_loads_from_a_config_without_any_import(installed):
    assert "ep_countdown" in registered_envs()  # listed before its module is imported
    assert "ep_envs_pkg" not in sys.modules
    job = load_config(JobConfig, CONFIG, ["tasks.train=[{name: ep_countdown, options: {n: 3}}]"])
    assert "ep_envs_pkg" in sys.modules  # the config's name imported it
    assert job.tasks.train[0].name == "ep_countdown" and job.tasks.train[0].options == {"n": 3}
    with pytest.raises(ValueError, match=r"tasks\.train\[0\]\.options\.n=0: must be >= 1"):
        load_config(JobConfig, CONFIG, ["tasks.train=[{name: ep_countdown, options: {n: 0}}]"])
    env = make_env("ep_countdown", n=2)
    assert env.reset(0) == "2 left"
    assert env.step("tick").done is False
    last = env.step("tick")
    assert (last.done, last.reward, last.info) == (True, 1.0, {"ticks": 2})
    # its evaluation metrics: the class's own hook, with the entry's options
    spec = EnvSpec(name="ep_countdown", options={"n": 2})
    assert episode_metrics(spec, [{"ticks": 2}, {"ticks": 0}]) == {"mean_ticks": 1.0, "n": 2.0}


def test_an_entry_point_whose_module_registers_nothing_names_it(installed):
    with pytest.raises(ValueError) as e:
        EnvSpec(name="ep_silent")
    msg = str(e.value)
    assert "entry point ep_silent = ep_envs_pkg.silent of ep-envs-pkg" in msg
    assert "registered no environment 'ep_silent'" in msg
    assert "@register_env('ep_silent')" in msg


def test_the_envs_cli_lists_entry_points_and_imports_plugins(installed, capsys):
    out = io.StringIO()
    with redirect_stdout(out):
        assert envs_main(["list"]) == 0
    assert "ep_countdown" in out.getvalue().split()
    with redirect_stdout(out := io.StringIO()):
        assert envs_main(["options", "ep_countdown"]) == 0
    assert "| `n` |" in out.getvalue()
    err = io.StringIO()
    with redirect_stderr(err):
        assert envs_main(["--import", "nowhere/plugin.py", "list"]) == 2
    assert "--import: cannot import 'nowhere/plugin.py': no such file" in err.getvalue()


def test_agent_is_registered_by_the_gateway_on_first_use():
    """In a fresh process: importing the environments imports nothing of `rollout`; naming
    `agent` imports the gateway's registration and checks its options against AgentOptions."""
    code = textwrap.dedent(
        """
        import json, sys
        from sao_megatron.envs import EnvSpec, options_schema, registered_envs
        before = sorted(m for m in sys.modules if m.startswith("sao_megatron.rollout"))
        listed = "agent" in registered_envs()
        agent = "examples/agents/calculator_agent.py:"
        spec = EnvSpec(name="agent", options={"agent": agent + "run", "task": agent + "make_task"})
        try:
            EnvSpec(name="agent", options={"agent": "run", "task": "m:t"})
            error = None
        except ValueError as e:
            error = str(e)
        print(json.dumps({
            "before": before,
            "listed": listed,
            "schema": options_schema("agent").__module__,
            "gateway": "sao_megatron.rollout.gateway.environment" in sys.modules,
            "env": type(spec.build()).__name__,
            "error": error,
        }))
        """
    )
    p = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["before"] == [] and out["listed"] is True
    assert out["schema"] == "sao_megatron.rollout.gateway.environment" and out["gateway"]
    assert out["env"] == "AgentEnvironment"
    assert out["error"].startswith(
        "EnvSpec.options.agent='run': give 'package.module:function' or 'file.py:function'"
    )


def test_builtin_episode_metrics_hanoi_and_latency_wrapped_hanoi():
    infos = [
        {"num_optimal_moves": 7, "num_steps": 8, "num_illegal_moves": 1,
         "num_malformed_actions": 0, "num_non_optimal_moves": 1},
        {"num_optimal_moves": 3, "num_steps": 2, "num_illegal_moves": 0,
         "num_malformed_actions": 1, "num_non_optimal_moves": 0},
    ]  # fmt: skip
    want = {
        "illegal_move_rate": 2 / 10,
        "non_optimal_move_rate": 1 / 10,
        "malformed_action_rate": 1 / 10,
        "num_moves": 10.0,
    }
    hanoi = EnvSpec(name="hanoi", options={"horizon": 7})
    assert episode_metrics(hanoi, infos) == pytest.approx(want)
    wrapped = EnvSpec(name="latency", options={"env": {"name": "hanoi"}, "median_s": 0.0})
    assert episode_metrics(wrapped, infos) == pytest.approx(want)
    assert episode_metrics(EnvSpec(name="chain_sum"), [{"success": True}]) == {}
