"""Typed contracts exchanged between stages (trajectories, batches) and data utilities."""
