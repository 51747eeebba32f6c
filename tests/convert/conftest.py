"""Fixtures of the conversion tests."""

import pytest


@pytest.fixture
def no_megatron():
    """No Megatron world in this process: the CLI sets up (and tears down) its own."""
    from megatron.core import parallel_state as ps

    from sao_megatron.parallel import destroy_parallel

    if ps.model_parallel_is_initialized():
        destroy_parallel()
    yield
