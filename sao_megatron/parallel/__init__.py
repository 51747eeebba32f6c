"""Process groups and Megatron parallel_state set-up (the only place that touches it)."""
