"""The PS shard: blocking synchronous aggregation with the optimizer on the shard."""
