"""A small GPT trained with PyTorch DDP (`examples/gpt_ddp.py`), the way DDP scripts are written, and the same
script ported to IMerge (`examples/gpt_imerge.py`); `diff examples/gpt_ddp.py examples/gpt_imerge.py` shows every
line that changed: the import and the wrap line.

    torchrun --nproc-per-node 2 examples/gpt_ddp.py --out ddp.pt
    imerge launch --shards 1 --workers 2 -- python examples/gpt_imerge.py --out imerge.pt

AdamW in two parameter groups (no weight decay on biases and norms), a per-iteration learning rate set on
optimizer.param_groups, gradient accumulation (DDP's require_backward_grad_sync), torch's GradScaler (enabled by
--dtype float16, as in nanoGPT) unscaled before clipping after backward, the token embedding tied to the output
layer, a DistributedSampler and the script's own process group, and the model saved right after the loop.
"""
import argparse
import json
import math

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, bias=False, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        causal = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), diagonal=1)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, heads: int = 4, layers: int = 2, context: int = 16):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # weight tying

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        return self.head(self.norm(self.blocks(x)))


def learning_rate(iteration: int, iterations: int, peak: float = 3e-3, warmup: int = 3) -> float:
    if iteration < warmup:
        return peak * (iteration + 1) / warmup
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * (iteration - warmup) / (iterations - warmup)))


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--out", default="model.pt")
    parser.add_argument("--losses", default="")
    parser.add_argument("--accumulate", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--grad-clip", type=float, default=0.5)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (96, 17))
    model = GPT()
    model = DDP(model)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3, betas=(0.9, 0.95))
    sampler = DistributedSampler(TensorDataset(tokens), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(tokens), batch_size=8, sampler=sampler, drop_last=True)
    scaler = torch.amp.GradScaler("cpu", enabled=(args.dtype == "float16"))
    autocast = torch.autocast("cpu", dtype=getattr(torch, args.dtype), enabled=args.dtype != "float32")
    losses = []
    for iteration, (batch,) in enumerate(loader):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(iteration, len(loader))
        total = 0.0
        for micro, chunk in enumerate(batch.chunk(args.accumulate)):
            model.require_backward_grad_sync = micro == args.accumulate - 1
            with autocast:
                logits = model(chunk[:, :-1])
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), chunk[:, 1:].reshape(-1)) / args.accumulate
            scaler.scale(loss).backward()
            total += loss.item()
        if args.grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
        print(f"iteration {iteration} loss {total:.6f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
        if args.losses:
            with open(args.losses, "w") as file:
                json.dump(losses, file)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
