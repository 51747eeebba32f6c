"""`sao-train` command line: --print-config with overrides in any position, config errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sao_megatron.cli.train import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "examples" / "configs" / "bench_long_horizon.yaml")


@pytest.mark.parametrize("flag_first", [True, False])
def test_print_config_applies_overrides_wherever_the_flag_is(capsys, flag_first):
    overrides = [
        "algorithm.importance.weighting=ppo_clip",
        "value.freeze_patterns=[embedding]",
        "rl.time_budget_s=90",
    ]
    argv = [CONFIG, "--print-config", *overrides] if flag_first else [CONFIG, *overrides]
    argv += [] if flag_first else ["--print-config"]
    assert main(argv) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["algorithm"]["importance"]["weighting"] == "ppo_clip"
    assert cfg["value"]["freeze_patterns"] == ["embedding"]
    assert cfg["rl"]["time_budget_s"] == 90
    assert cfg["tasks"]["train"][0]["options"]["reward_mode"] == "progress"


def test_bad_override_exits_2_naming_the_field(capsys):
    with pytest.raises(SystemExit) as e:
        main([CONFIG, "--print-config", "rl.time_budget_s=-5"])
    assert e.value.code == 2
    assert "rl.time_budget_s" in capsys.readouterr().err
