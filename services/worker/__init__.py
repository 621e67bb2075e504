"""The worker: wraps a torch.nn.Module and syncs it with the PS shards."""
