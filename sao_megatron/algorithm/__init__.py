"""Pure tensor math of SAO and GRPO: advantages, importance weights, losses, metrics."""
