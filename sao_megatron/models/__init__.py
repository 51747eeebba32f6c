"""Megatron-Core policy and value models, freezing, and log-prob/entropy computation."""
