"""Resumable, prefetching input pipeline: ``GlobalBatchSampler`` (exactly-once on any world size)
and ``DataLoader`` (torch workers + a prefetch thread, cache, retries, corrupt-sample policy)."""

from trainmesh.data.guard import CorruptSampleError
from trainmesh.data.loader import DataLoader, LoaderStats
from trainmesh.data.sampler import GlobalBatchSampler
from trainmesh.data.shard_writer import write_char_shards, write_token_shards
from trainmesh.data.shards import ShardError, TokenShardDataset

__all__ = [
    "CorruptSampleError",
    "DataLoader",
    "GlobalBatchSampler",
    "LoaderStats",
    "ShardError",
    "TokenShardDataset",
    "write_char_shards",
    "write_token_shards",
]
