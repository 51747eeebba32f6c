"""Trainer: Megatron forward/backward for policy and value, the controller loop, checkpoints."""
