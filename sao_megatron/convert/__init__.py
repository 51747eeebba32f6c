"""HF <-> Megatron checkpoint conversion (also the weight-sync mapping to rollout engines)."""
