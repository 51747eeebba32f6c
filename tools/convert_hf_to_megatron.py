#!/usr/bin/env python
"""Thin wrapper: ``sao-convert hf-to-megatron ...`` (see ``--help`` and docs/CONVERSION.md)."""

import sys

from sao_megatron.convert.cli import main

if __name__ == "__main__":
    sys.exit(main(["hf-to-megatron", *sys.argv[1:]]))
