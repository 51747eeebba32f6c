"""RL algorithms (registry, SAO, GRPO, GRPO+DIS) and their pure tensor math."""

# Importing the algorithm modules registers them (registry.register); a new algorithm file
# is added to this line.
from . import grpo, grpo_dis, sao  # noqa: F401
