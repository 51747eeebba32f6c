"""Command-line entry points: `sao-train`, `sao-plan`, `sao-serve` (a cluster's engine step) and
``python -m sao_megatron.cli.envs`` (environments, their options, sample episodes)."""
