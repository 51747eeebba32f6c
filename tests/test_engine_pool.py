"""tests/engine_pool.py shares an engine only between jobs whose own engines would be the same:
every rollout field that changes the engine's command line or environment changes its key."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from sao_megatron.rollout.config import RolloutConfig
from sao_megatron.rollout.engine import EngineProcess
from tests.engine_pool import engine_key

HF = {"model_type": "qwen3_moe", "vocab_size": 320, "eos_token_id": 2}
#: another valid value of each field whose default would not do as "+1" / "not" / "* 2"
OTHER = {
    "engine_urls": ["http://127.0.0.1:1"],
    "engine_urls_file": "urls.json",
    "dtype": "float32",
    "vllm_python": "/usr/bin/python3",
    "extra_engine_args": ["--max-num-seqs", "4"],
    "requeue_statuses": ["engine_error"],
    "stop_token_ids": [5],
    "seed": 7,
    "top_p": 0.9,
    "max_tokens_per_action": 8,
    "deviation_target": 0.05,
    "step_timeout_s": 30.0,
    "episode_timeout_s": 60.0,
}


def _other(f: dataclasses.Field, value):
    if f.name in OTHER:
        return OTHER[f.name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int | float):
        return value * 2
    raise AssertionError(f"give tests/test_engine_pool.py an OTHER value for rollout.{f.name}")


def _engine(cfg: RolloutConfig, model) -> tuple[list[str], dict[str, str]]:
    p = EngineProcess(cfg, 0, model, model)
    return p.command(), p.environment()


@pytest.mark.parametrize("name", [f.name for f in dataclasses.fields(RolloutConfig)])
def test_a_field_that_changes_the_engine_changes_the_key(name, tmp_path):
    base = RolloutConfig(vllm_python=sys.executable, seed=0)
    f = next(f for f in dataclasses.fields(RolloutConfig) if f.name == name)
    changed = dataclasses.replace(base, **{name: _other(f, getattr(base, name))})
    if name == "vllm_python":
        changed = dataclasses.replace(base, vllm_python=str(tmp_path / "python"))
        (tmp_path / "python").touch()
    if _engine(changed, tmp_path) != _engine(base, tmp_path):
        assert engine_key(HF, changed) != engine_key(HF, base), name


def test_the_key_holds_the_model_config_and_routing_capture():
    cfg = RolloutConfig(seed=0)
    assert engine_key(HF, cfg) != engine_key(HF | {"eos_token_id": 3}, cfg)
    # turned on by the job's rollout (`RolloutManager._setup`), never off again
    assert engine_key(HF, cfg) != engine_key(HF, dataclasses.replace(cfg, record_routing=True))
    # the seed itself goes with each request, not to the engine; without one, chunked prefill
    assert engine_key(HF, cfg) == engine_key(HF, dataclasses.replace(cfg, seed=5))
    assert engine_key(HF, cfg) != engine_key(HF, dataclasses.replace(cfg, seed=None))
