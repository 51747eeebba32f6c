"""``sao-train`` with recorders for the agent-job test: runs ``sao_megatron.cli.train.main``
unchanged and appends to ``<run_dir>/record.jsonl`` one line per packed batch (every trajectory's
task, status, info and per-node tokens, behaviour log-probs, versions and rewards) and one line
per advantage computation (the ``node_rewards`` the algorithm's advantage function — and so
the value targets and the policy loss — receives, with their task ids)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sao_megatron.cli import train
from sao_megatron.trainer import context, step_advantages

_pack = context.pack_trajectories
_advantage_inputs = step_advantages.StepAdvantages.inputs


def _write(record: dict) -> None:
    with (Path(_RUN_DIR) / "record.jsonl").open("a") as f:
        f.write(json.dumps(record) + "\n")


def _recording_pack(trajs, **kw):
    _write(
        {
            "kind": "batch",
            "trajectories": [
                {
                    "task_id": t.task_id,
                    "status": t.status,
                    "info": {k: v for k, v in t.info.items() if isinstance(v, str | int | float)},
                    "truncated": t.truncated,
                    "nodes": [
                        {
                            "observation": n.observation_token_ids,
                            "action": n.action_token_ids,
                            "behaviour_logprobs": n.behaviour_logprobs,
                            "policy_versions": n.policy_versions,
                            "reward": n.reward,
                        }
                        for n in t.nodes
                    ],
                }
                for t in trajs
            ],
        }
    )
    return _pack(trajs, **kw)


def _recording_advantage_inputs(self, rank):
    inputs = _advantage_inputs(self, rank)
    _write(
        {
            "kind": "advantage_inputs",
            "task_ids": list(rank.trajectories.task_ids),
            "node_rewards": inputs.node_rewards.tolist(),
        }
    )
    return inputs


if __name__ == "__main__":
    _RUN_DIR = next(a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("run_dir="))
    context.pack_trajectories = _recording_pack
    step_advantages.StepAdvantages.inputs = _recording_advantage_inputs
    sys.exit(train.main(sys.argv[1:]))
