"""Recorded RL batches (`sao_megatron.trainer.batch_record`): a recorded SAO run replayed from
its step-1 checkpoint trains bit-identically (metrics and final weights), a changed algorithm
option changes the replay, and the files are resume-safe (1 rank, real Megatron, no vLLM: an
in-process rollout whose batches are random on every run, as an asynchronous rollout's are)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sao_megatron.configs import load_config
from sao_megatron.data.trajectory import ActionNode, Trajectory
from sao_megatron.rollout.status import StatusCounters
from sao_megatron.trainer import rl_parts as rl_parts_module
from sao_megatron.trainer.batch_record import BatchRecorder, BatchReplay, MissingBatch, batch_file
from sao_megatron.trainer.controller import Controller
from sao_megatron.trainer.job import JobConfig
from tests.conftest import tiny_moe_kwargs

#: metrics a replay must reproduce exactly (everything the update computes)
REPLAYED = ("loss/", "value/", "policy/", "grad_norm/", "deviation/", "reward/", "episode/")


def _trajectory(rng: random.Random, task_id: str, version: int, vocab: int) -> Trajectory:
    nodes = []
    for _ in range(rng.randint(1, 3)):
        n = rng.randint(2, 5)
        nodes.append(
            ActionNode(
                observation_token_ids=[rng.randrange(4, vocab) for _ in range(rng.randint(3, 9))],
                action_token_ids=[rng.randrange(4, vocab) for _ in range(n)],
                # near the random tiny model's own log-probs (~ -log V): ratios inside the DIS
                # band, so the policy trains (far-off ones would all be masked: loss 0)
                behaviour_logprobs=[-math.log(vocab) + rng.uniform(-0.2, 0.2) for _ in range(n)],
                policy_versions=[max(version - rng.randint(0, 2), 0) for _ in range(n)],
                reward=float(rng.random() < 0.4),
            )
        )
    cut = rng.random() < 0.25
    nodes[-1].truncated = cut
    return Trajectory(
        task_id=task_id, nodes=nodes, terminated=not cut, truncated=cut, status="completed"
    )


class RandomRollout:
    """A stand-in for `RolloutManager`: each batch is drawn from the task stream with fresh
    randomness (never the same twice), like an asynchronous rollout's timing."""

    def __init__(self, cfg, formatter, tasks, **_) -> None:
        self.cfg, self.tasks, self.vocab = cfg, tasks, formatter.tokenizer.vocab_size
        self.rng = random.Random()  # seeded from the OS: a second run samples other batches
        self.status_counters = StatusCounters()
        self.urls: list[str] = []

    def start(self):
        return self

    def stop(self) -> None:
        pass

    def get_batch(self, version, timeout=None):
        n = self.cfg.trajectories_per_batch
        tasks = [next(self.tasks) for _ in range(n)]
        out = [_trajectory(self.rng, t.task_id, version, self.vocab) for t in tasks]
        return out[::-1]  # the controller sorts them

    def publish_weights(self, weights, version):
        return type("Sync", (), {"max_pause_s": 0.0, "write_s": 0.0, "failed_engines": []})()

    def observe_step(self, metrics):
        return {}

    def stats(self):
        return {}

    def state_dict(self) -> dict:  # the Stateful ``rollout`` of a checkpoint, as RolloutManager's
        return {"status_counts": self.status_counters.state_dict(), "deviation": None}

    def load_state_dict(self, state: dict) -> None:
        self.status_counters.load_state_dict(state["status_counts"])


class NoRollout:
    def __init__(self, *a, **k) -> None:
        raise AssertionError("a replay without evaluation started a rollout")


def _job(run_dir: Path, *overrides: str, config: Path | None = None) -> JobConfig:
    base = []
    if config is None:
        model = [f"model.{k}={v}" for k, v in tiny_moe_kwargs().items() if k != "vocab_size"]
        base = [
            *model,
            "model.vocab_size=1024",
            "model.max_position_embeddings=512",
            "tokenizer.vocab_size=1000",
            "demonstrations.num_episodes=8",
            "demonstrations.envs=[{name: chain_sum}]",
            "stages=[rl]",
            "algorithm.name=sao",
            "rollout.trajectories_per_batch=4",
            "rollout.max_staleness=2",
            "rl.micro_batch_size=2",
            "tasks.num_eval_tasks=0",
            "checkpoint.save_interval=1",
            "checkpoint.keep_last_k=0",
            "logging.console=false",
            "logging.tensorboard=false",
        ]
    return load_config(JobConfig, config, [*base, f"run_dir={run_dir}", *overrides])


def _records(run_dir: Path) -> dict[int, dict]:
    lines = (run_dir / "rl" / "metrics.jsonl").read_text().splitlines()
    recs = [json.loads(line) for line in lines]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith(REPLAYED)} for r in recs}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The final policy export's tensors (sharded safetensors)."""
    out = {}
    for f in sorted((run_dir / "hf_policy_final").glob("*.safetensors")):
        out |= load_file(f)
    assert out, f"no safetensors in {run_dir / 'hf_policy_final'}"
    return out


def _replay(parallel, src: Path, out: Path, *overrides: str) -> dict[int, dict]:
    job = _job(
        out,
        f"rl.replay_batches={src / 'rl' / 'batches'}",
        "rl.record_batches=false",
        f"checkpoint.resume={src / 'checkpoints' / 'rl' / 'step_00000001'}",
        *overrides,
        config=src / "config.yaml",  # the config the recorded run trained with
    )
    out.mkdir()  # as sao-train does
    Controller(job, parallel).run()
    return _records(out)


def test_a_recorded_run_replays_bit_identically(tmp_path, parallel_1rank, monkeypatch):
    monkeypatch.setattr(rl_parts_module, "RolloutManager", RandomRollout)
    rec = tmp_path / "recorded"
    Controller(_job(rec, "rl.steps=4", "rl.record_batches=true"), parallel_1rank).run()
    recorded = _records(rec)
    folder = rec / "rl" / "batches"
    assert sorted(p.name for p in folder.iterdir()) == [f"step_{s:08d}.pt" for s in (1, 2, 3, 4)]
    first = torch.load(batch_file(folder, 3), weights_only=True)
    assert first["step"] == 3 and first["policy_version"] == 2 and first["bound"] is None
    lags = {2 - v for t in first["trajectories"] for n in t["nodes"] for v in n["policy_versions"]}
    assert lags == {0, 1, 2}  # tokens of three policy versions, as the staleness bound allows
    assert recorded[3]["deviation/version_lag_max"] == 2.0
    assert all(recorded[s]["loss/policy"] != 0.0 for s in recorded)  # the policy trains
    assert all(recorded[s]["deviation/dropped_fraction"] < 0.5 for s in recorded)

    monkeypatch.setattr(rl_parts_module, "RolloutManager", NoRollout)
    same = _replay(parallel_1rank, rec, tmp_path / "same")
    assert sorted(same) == [2, 3, 4]
    for step in (2, 3, 4):
        assert same[step] == recorded[step], step  # every value bit for bit
    assert {"loss/policy", "loss/value", "policy/advantage_mean"} <= set(same[2])
    a, b = _weights(rec), _weights(tmp_path / "same")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    whitened = _replay(parallel_1rank, rec, tmp_path / "whiten", "algorithm.whiten_advantages=true")
    for step in (2, 3, 4):  # the critic trains on the same batches: its part is unchanged
        assert whitened[step]["loss/value"] == recorded[step]["loss/value"]
        assert whitened[step]["loss/policy"] != recorded[step]["loss/policy"]
        assert whitened[step]["policy/advantage_mean"] != recorded[step]["policy/advantage_mean"]

    # tools/replay_batches.py runs this replay as `sao-train` with these overrides (a
    # subprocess costs ~20 s more of the suite; the controller run above is the same job)
    tool = _tool()
    ckpt = rec / "checkpoints" / "rl" / "step_00000001"
    cmd = tool.replay_command(rec, ckpt, tmp_path / "tool", ["algorithm.whiten_advantages=true"], 0)
    assert cmd[3:] == [
        str(rec / "config.yaml"),
        f"run_dir={tmp_path / 'tool'}",
        "stages=[rl]",
        f"rl.replay_batches={folder}",
        "rl.record_batches=false",
        f"checkpoint.resume={ckpt}",
        "tasks.num_eval_tasks=0",
        "logging.console=false",
        "algorithm.whiten_advantages=true",
    ]
    with pytest.raises(SystemExit, match="exists: a replay goes into a new folder"):
        tool.main(["--run", str(rec), "--checkpoint", str(ckpt), "--out", str(tmp_path / "same")])
    table = tool.compare_text([rec, tmp_path / "whiten"])
    assert "| policy/advantage_mean (Q1 / Q2 / Q3 / Q4) |" in table

    # a replay past the recorded steps ends at the last one, with its checkpoint
    longer = _replay(parallel_1rank, rec, tmp_path / "longer", "rl.steps=6")
    assert sorted(longer) == [2, 3, 4]
    assert (tmp_path / "longer" / "checkpoints" / "rl" / "step_00000004").is_dir()


def _tool():
    import importlib.util
    import sys

    tools = Path(__file__).resolve().parents[2] / "tools"
    sys.path.insert(0, str(tools))
    spec = importlib.util.spec_from_file_location("replay_batches", tools / "replay_batches.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _traj(task: str, tokens: int = 3, reward: float = 1.0) -> Trajectory:
    node = ActionNode(
        observation_token_ids=[5] * tokens,
        action_token_ids=[6, 7],
        behaviour_logprobs=[-0.5, -0.25],
        policy_versions=[1, 2],
        reward=reward,
        routed_experts=torch.zeros(tokens + 1, 2, 2, dtype=torch.uint8),
    )
    return Trajectory(task_id=task, nodes=[node], terminated=True)


def test_records_round_trip_and_a_resumed_run_never_overwrites_another_batch(tmp_path):
    rec = BatchRecorder(tmp_path / "b")
    path = rec.record(1, 0, [_traj("chain_sum:0"), _traj("chain_sum:1")], bound=None)
    trajs, version, bound = BatchReplay(tmp_path / "b", max_seq_len=64).load(1)
    assert (
        version == 0
        and bound is None
        and [t.task_id for t in trajs] == ["chain_sum:0", "chain_sum:1"]
    )
    got, want = trajs[0].nodes[0], _traj("chain_sum:0").nodes[0]
    assert torch.equal(got.routed_experts, want.routed_experts)
    assert got.routed_experts.dtype == torch.uint8
    got.routed_experts = want.routed_experts = None
    assert got == want and trajs[0].terminated and trajs[0].status == "completed"

    mtime = path.stat().st_mtime_ns
    rec.record(1, 0, [_traj("chain_sum:0"), _traj("chain_sum:1")], bound=None)  # the same batch
    assert path.stat().st_mtime_ns == mtime and len(list((tmp_path / "b").iterdir())) == 1
    rec.record(1, 0, [_traj("chain_sum:0", reward=0.0)], bound=None)  # a resumed run's new one
    rec.record(1, 0, [_traj("chain_sum:0", reward=0.5)], bound=None)
    names = sorted(p.name for p in (tmp_path / "b").iterdir())
    assert names == [
        "step_00000001.pt",
        "step_00000001.superseded_0.pt",
        "step_00000001.superseded_1.pt",
    ]
    old = torch.load(tmp_path / "b" / "step_00000001.superseded_0.pt", weights_only=True)
    assert len(old["trajectories"]) == 2  # the first record, kept
    assert BatchReplay(tmp_path / "b", 64).load(1)[0][0].nodes[0].reward == 0.5

    with pytest.raises(MissingBatch, match="no batch for step 2 .*steps 1..1"):
        BatchReplay(tmp_path / "b", 64).load(2)
    rec.record(2, 1, [_traj("chain_sum:2", tokens=40)], bound=3)
    with pytest.raises(ValueError, match="42 tokens.*max_position_embeddings=32"):
        BatchReplay(tmp_path / "b", max_seq_len=32).load(2)
    with pytest.raises(ValueError, match="rl.replay_batches=.*rl.record_batches=true"):
        BatchReplay(tmp_path / "empty", 64)
