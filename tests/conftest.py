# Fixtures shared by every test directory.
from trainmesh.testing.fixtures import netns_cluster  # noqa: F401
