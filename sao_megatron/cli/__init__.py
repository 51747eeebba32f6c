"""Command-line entry points (`sao-train`)."""
