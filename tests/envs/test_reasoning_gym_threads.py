"""Environments built from many threads at once, in a fresh interpreter that has not imported
reasoning-gym yet (as rollout workers do): every build sees the full dataset registry."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import threading
from sao_megatron.envs import make_env
errors, obs = [], []
def build():
    try:
        env = make_env("chain_sum", reward="last_number", difficulty={"max_digits": 1})
        obs.append(env.reset(seed=1))
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=build) for _ in range(16)]
[t.start() for t in threads]
[t.join() for t in threads]
print(len(obs), len(set(obs)), errors[:1])
"""


def test_concurrent_first_builds_all_succeed():
    out = subprocess.run(
        [sys.executable, "-c", CODE], capture_output=True, text=True, check=True, timeout=300
    )
    assert out.stdout.split()[:2] == ["16", "1"], out.stdout + out.stderr[-2000:]
