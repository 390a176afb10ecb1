# Fixtures shared by every test directory.
from trainmesh.testing.fixtures import netns_cluster  # noqa: F401

import pytest


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """Applying a distribution in one process initialises a one-process group; tests after it (the
    planner's fake process group, the checks that run before any group exists) need none, so a group
    the test started is shut down again. Autouse: a test that builds a Trainer in the pytest process
    and forgets it would otherwise break every later test that needs no group (it did, once)."""
    import torch.distributed as dist

    before = dist.is_initialized()
    yield
    if dist.is_initialized() and not before:
        import trainmesh as tm

        tm.shutdown()
