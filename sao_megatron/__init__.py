"""sao_megatron: single-trajectory asynchronous RL (SAO) and GRPO for MoE LLMs on Megatron-Core."""

__version__ = "0.1.0"
