"""Asynchronous rollout: vLLM engines, router, episode runner, trajectory buffer, weight sync."""
