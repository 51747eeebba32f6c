#!/usr/bin/env bash
# Wheels for tools/gpu_check.py on the lent GPU machine, and the device call to make (what and why: tools/gpu_check_prepare.py; --dry-run lists them without fetching).
exec "${PYTHON:-$(dirname "$0")/../.venv/bin/python}" "$(dirname "$0")/gpu_check_prepare.py" "$@"
