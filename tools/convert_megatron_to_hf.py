#!/usr/bin/env python
"""Thin wrapper: ``sao-convert megatron-to-hf ...`` (see ``--help`` and docs/CONVERSION.md)."""

import sys

from sao_megatron.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["megatron-to-hf", *sys.argv[1:]]))
