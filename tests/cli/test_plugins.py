"""Plug-in modules: `sao-train --import MODULE` and the config's `plugins:` list; a plug-in
algorithm (examples/algorithms/rebn.py) selected, validated, its math, and trained 3 steps."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from sao_megatron.cli.train import main
from sao_megatron.configs import load_config
from sao_megatron.plugins import import_plugin
from sao_megatron.trainer.job import JobConfig
from tests.tiny_job import TINY as JOB_TINY

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "configs" / "quickstart.yaml")
REBN = "examples/algorithms/rebn.py"
RL_ONLY = ["stages=[sft,rl]"]  # quickstart's value_pretrain stage needs a critic
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def _exit_line(capsys, argv: list[str]) -> str:
    """The one line `main(argv)` prints before exiting with code 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and err.count("\n") == 1, err  # one line, no traceback
    return err.strip()


def _print_config(capsys, argv: list[str]) -> dict:
    assert main([*argv, "--print-config"]) == 0
    return yaml.safe_load(capsys.readouterr().out)


# ------------------------------------------------------------------ --import and plugins:
def test_import_of_a_missing_module_is_one_line_naming_it_and_the_exception(capsys, tmp_path):
    line = _exit_line(capsys, [CONFIG, "--import", "no_such_plugin_xyz", f"run_dir={tmp_path}/r"])
    assert line.startswith("sao-train: plug-in error: --import: cannot import 'no_such_plugin_xyz'")
    assert "ModuleNotFoundError: No module named 'no_such_plugin_xyz'" in line
    assert not (tmp_path / "r").exists()  # before any stage: nothing was started
    line = _exit_line(capsys, [CONFIG, "--import", "nowhere/plugin.py", "--print-config"])
    assert "cannot import 'nowhere/plugin.py': no such file" in line


def test_a_plugin_that_raises_is_one_line_with_its_exception_and_line(capsys, tmp_path):
    bad = tmp_path / "broken_plugin.py"
    bad.write_text("x = 1\nraise RuntimeError('boom\\nsecond line')\n")
    line = _exit_line(capsys, [CONFIG, "--import", str(bad), "--print-config"])
    assert f"cannot import {str(bad)!r}: RuntimeError: boom (at {bad}:2)" in line
    # the same from the config's plugins list (load_config imports it)
    line = _exit_line(capsys, [CONFIG, f"plugins=[{bad}]", "--print-config"])
    assert line.startswith("sao-train: plug-in error: plugins: cannot import")
    assert "RuntimeError: boom" in line


def test_rebn_is_unknown_without_its_module_and_the_error_says_how_to_import_it(
    capsys, monkeypatch
):
    from sao_megatron.algorithm import registry

    monkeypatch.delitem(registry._REGISTRY, "rebn", raising=False)  # as in a fresh process
    line = _exit_line(capsys, [CONFIG, "algorithm.name=rebn", "--print-config"])
    assert "algorithm.name='rebn': not a registered algorithm" in line
    assert "--import MODULE" in line


def test_import_flag_selects_the_plugin_algorithm_and_records_it(capsys):
    cfg = _print_config(capsys, [CONFIG, "--import", REBN, "algorithm.name=rebn", *RL_ONLY])
    assert cfg["plugins"] == [REBN]  # recorded: run_dir/config.yaml re-imports it
    algo = cfg["algorithm"]
    assert algo["name"] == "rebn"
    assert algo["options"] == {"eps": 1e-6, "std_normalize": True}  # defaults filled in
    assert algo["importance"]["weighting"] == "tis"  # the plug-in's default
    # options from the command line, typed by the plug-in's dataclass
    cfg = _print_config(
        capsys,
        [CONFIG, "algorithm.name=rebn", "--import", REBN, "algorithm.options.eps=1e-3",
         "algorithm.options.std_normalize=false", *RL_ONLY],
    )  # fmt: skip
    assert cfg["algorithm"]["options"] == {"eps": 1e-3, "std_normalize": False}


def test_plugins_key_of_a_yaml_config_loads_and_validates(tmp_path):
    path = tmp_path / "rebn.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                **yaml.safe_load(Path(CONFIG).read_text()),
                "plugins": [REBN],
                "stages": ["sft", "rl"],
                "algorithm": {"name": "rebn", "options": {"eps": 0.01}},
            }
        )
    )
    job = load_config(JobConfig, path)
    assert job.plugins == [REBN] and job.algorithm.name == "rebn"
    from sao_megatron.algorithm import registry

    algo = registry.build(job.algorithm)
    assert type(algo).__name__ == "ReBN" and algo.options.eps == 0.01
    assert not algo.needs_value_model and algo.group_size == 1
    # importing the file again (by path or by its dotted name) runs it once: no re-registration
    assert import_plugin(REBN) is import_plugin(str(ROOT / REBN))
    assert import_plugin("examples.algorithms.rebn") is import_plugin(REBN)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "algorithm.options.epz=1",
            "algorithm.options.epz: not an option of algorithm.name='rebn'",
        ),
        ("algorithm.options.eps=-1", "algorithm.options.eps=-1: must be a number > 0"),
        ("algorithm.sao.gamma=0.9", "algorithm.sao.gamma=0.9 is ignored by algorithm.name='rebn'"),
        ("algorithm.importance.weighting=ppo_clip", "does not apply to algorithm.name='rebn'"),
    ],
)
def test_plugin_options_are_validated(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(JobConfig, CONFIG, [f"plugins=[{REBN}]", "algorithm.name=rebn", override])


def test_builtin_algorithms_take_no_options():
    with pytest.raises(ValueError, match=r"algorithm.options.x is ignored by algorithm.name='sao'"):
        load_config(JobConfig, CONFIG, ["algorithm.options.x=1"])
    assert load_config(JobConfig, CONFIG, []).algorithm.options == {}


def test_serve_takes_the_same_import_flag(capsys):
    from sao_megatron.cli.serve import main as serve_main

    with pytest.raises(SystemExit) as e:
        serve_main([CONFIG, "--import", "no_such_plugin_xyz"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "plug-in error: --import: cannot import 'no_such_plugin_xyz'" in err
    assert err.count("\n") == 1
    # the SLURM script's spelling: a config without rollout.engine_urls_file stops before any
    # engine starts, in one line
    p = subprocess.run(
        [sys.executable, "-m", "sao_megatron.cli.serve", CONFIG],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2, p.stdout + p.stderr
    last = p.stderr.strip().splitlines()[-1]  # (after the warnings of third-party imports)
    assert last.startswith("sao-serve: config error: rollout.engine_urls_file is not set")


# ------------------------------------------------------------------ ReBN's math
def _rebn():
    return import_plugin(REBN)


def test_rebn_advantages_match_a_float64_reference():
    rebn = _rebn()
    torch.manual_seed(0)
    b, n, t = 5, 3, 9
    node_rewards = torch.randn(b, n, dtype=torch.float32)
    node_rewards[1, 2] = 0.0
    action_mask = torch.rand(b, t) < 0.6
    eps = 1e-3
    adv = rebn.rebn_advantages(node_rewards, action_mask, eps)
    returns = [sum(float(x) for x in row) for row in node_rewards.double()]
    mean = sum(returns) / b
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / b)
    for i in range(b):
        for j in range(t):
            want = (returns[i] - mean) / (std + eps) if action_mask[i, j] else 0.0
            assert adv[i, j].item() == pytest.approx(want, rel=1e-6, abs=1e-7)
    centred = rebn.rebn_advantages(node_rewards, action_mask, eps, std_normalize=False)
    assert centred[0, action_mask[0]].unique().item() == pytest.approx(returns[0] - mean, rel=1e-6)
    # equal returns (and a batch of one) give zero advantages, not NaN
    assert torch.equal(
        rebn.rebn_advantages(torch.ones(3, 2), action_mask[:3], eps), torch.zeros(3, t)
    )
    assert torch.equal(
        rebn.rebn_advantages(torch.ones(1, 2), action_mask[:1], eps), torch.zeros(1, t)
    )


def test_rebn_statistics_are_the_global_batch_s_across_dp_ranks():
    """Two ranks (threads, a barrier-synchronised sum: tests/algorithm/test_whiten_reducer.py)
    holding 3 and 4 trajectories get the advantages of the 7-trajectory batch."""
    from tests.algorithm.test_whiten_reducer import ThreadGroup

    rebn = _rebn()
    torch.manual_seed(2)
    node_rewards = torch.randn(7, 4, dtype=torch.float64) + 3.0  # |mean| >> std: two passes
    mask = torch.rand(7, 6) < 0.6
    whole = rebn.rebn_advantages(node_rewards, mask, 1e-6)
    shares = [(node_rewards[:3], mask[:3]), (node_rewards[3:], mask[3:])]
    parts = ThreadGroup(2).run(lambda sh, red: rebn.rebn_advantages(*sh, 1e-6, True, red), shares)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-12, atol=1e-12)
    local = rebn.rebn_advantages(*shares[0], 1e-6)  # what rank 0 alone would compute
    assert (local - whole[:3]).abs().max() > 1e-3


def test_rebn_policy_loss_gradient_matches_a_float64_reference():
    from sao_megatron.algorithm import registry

    _rebn()
    job = load_config(JobConfig, CONFIG, [f"plugins=[{REBN}]", "algorithm.name=rebn", *RL_ONLY])
    algo = registry.build(job.algorithm)  # tis, cap 2.0, token_mean
    torch.manual_seed(1)
    b, t = 3, 6
    mask = torch.rand(b, t) < 0.7
    lp = (torch.randn(b, t) * 0.3 - 1.0).requires_grad_()
    lb = lp.detach() + torch.randn(b, t) * 0.8  # ratios well below and above the cap
    adv = torch.randn(b, t) * mask
    loss = algo.policy_loss(
        logprobs=lp, behaviour_logprobs=lb, advantages=adv, action_mask=mask, num_tokens=11
    )
    loss.backward()
    ref_loss, ref_grad = 0.0, torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        for j in range(t):
            if mask[i, j]:
                w = min(math.exp(float(lp[i, j].detach() - lb[i, j])), 2.0)  # sg(min(r, cap))
                ref_loss += -w * float(adv[i, j]) * float(lp[i, j].detach()) / 11
                ref_grad[i, j] = -w * float(adv[i, j]) / 11
    assert loss.item() == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    torch.testing.assert_close(lp.grad.double(), ref_grad, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ the real job path
TINY = [o for o in JOB_TINY if not o.startswith("checkpoint.")]  # no per-step checkpoints


@pytest.mark.integration
@pytest.mark.vllm
@pytest.mark.distributed
def test_rebn_trains_3_steps_on_2_ranks_through_sao_train(tmp_path, engine_pool):
    """torchrun starts 2 ranks of `sao-train --import rebn.py`; each rank resolves the config
    (an unknown algorithm on any rank would fail the job), the rollout runs a vLLM engine."""
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is absent: run `make vllm` (CI does)")
    run = tmp_path / "rebn"
    args = [f"run_dir={run}", *TINY, "algorithm.name=rebn", "rl.steps=3", "stages=[sft,rl]"]
    # the session's shared engine for this model; the pool resolves the config in this process,
    # which must import the plug-in too (it may run before any other test imported it)
    args += engine_pool.overrides(CONFIG, [*args, f"plugins=[{REBN}]"])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
        "-m", "sao_megatron.cli.train", CONFIG, "--import", REBN, *args,
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"sao-train failed ({p.returncode}):\n{out[-6000:]}"
    assert "not a registered algorithm" not in out and "plug-in error" not in out
    recs = [json.loads(x) for x in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["policy/update_ok"] + r["policy/skipped_zero_advantage"] == 1.0
        assert "loss/value" not in r  # no critic
        assert math.isfinite(r["loss/policy"])
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["plugins"] == [REBN] and saved["algorithm"]["name"] == "rebn"
    assert saved["algorithm"]["options"] == {"eps": 1e-6, "std_normalize": True}
    assert load_config(JobConfig, run / "config.yaml").algorithm.name == "rebn"
