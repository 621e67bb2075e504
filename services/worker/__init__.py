"""The worker: wraps a torch.nn.Module and syncs it with the PS shards.

gRPC's fork handlers are off in a worker (unless the environment sets them): a
process forked from the training script (a DataLoader worker) never uses the
job's channels (:mod:`.exiting` disowns the model there), and with the comm
thread calling into gRPC each fork would only log "Other threads are currently
calling into gRPC, skipping fork() handlers". gRPC reads the variable when it
is first imported, so this runs before any of the worker's modules import it.
"""
import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
