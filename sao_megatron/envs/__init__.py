"""Agent environments and tasks: the protocol, a registry, and the built-in environments."""
