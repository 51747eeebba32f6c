"""The tiny whole-job config the `sao-train` tests share: the quickstart config shrunk to a
2-layer, 128-wide MoE, a 320-token vocabulary and 2-step SFT, so a job takes seconds a stage."""

from __future__ import annotations

from sao_megatron.rollout.engine import REPO_ROOT

CONFIG = REPO_ROOT / "examples" / "configs" / "quickstart.yaml"

TINY = [
    "model.hidden_size=128",
    "model.num_hidden_layers=2",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=2",
    "model.num_experts=4",
    "model.moe_intermediate_size=64",
    "model.max_position_embeddings=512",
    "rollout.max_model_len=512",
    "tokenizer.vocab_size=320",
    "demonstrations.num_episodes=8",
    "demonstrations.envs=[{name: chain_sum}]",
    "tasks.train=[{name: chain_sum}]",
    "tasks.num_eval_tasks=2",
    "sft.steps=2",
    "sft.batch_size=8",
    "sft.micro_batch_size=4",
    "rollout.trajectories_per_batch=4",
    "rollout.max_concurrent_episodes=4",
    "rollout.max_tokens_per_action=8",
    "rl.micro_batch_size=2",
    "checkpoint.save_interval=1",
    "logging.console=false",
    "logging.tensorboard=false",
]
