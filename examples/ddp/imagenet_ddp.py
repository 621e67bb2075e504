"""The shape of pytorch/examples' `imagenet/main.py` under torchrun, on CPU with gloo and synthetic images: a
DataLoader with worker processes over a DistributedSampler, AverageMeter and ProgressMeter, a validation pass,
a StepLR scheduler, and a checkpoint each epoch from rank 0 with the model's, the optimizer's and the scheduler's
state_dict(). `imagenet_imerge.py` is this file with the import and the wrap line changed. --losses (an addition
for the comparison) writes rank 0's loss per step.

    torchrun --nproc-per-node 2 examples/ddp/imagenet_ddp.py --epochs 2 --checkpoint checkpoint.pth.tar
    imerge launch --shards 1 --workers 2 -- python examples/ddp/imagenet_imerge.py --epochs 2
"""
import argparse
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def images(count: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(count, 3, 16, 16, generator=generator),
                         torch.randint(0, 10, (count,), generator=generator))


def small_resnet() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def main() -> None:
    parser = argparse.ArgumentParser(description="ImageNet-shaped training", allow_abbrev=False)
    parser.add_argument("--epochs", default=2, type=int)
    parser.add_argument("-b", "--batch-size", default=16, type=int)
    parser.add_argument("--lr", "--learning-rate", default=0.05, type=float, dest="lr")
    parser.add_argument("--momentum", default=0.9, type=float)
    parser.add_argument("--wd", "--weight-decay", default=1e-4, type=float, dest="weight_decay")
    parser.add_argument("-j", "--workers", default=2, type=int, help="data loading workers per process")
    parser.add_argument("-p", "--print-freq", default=4, type=int)
    parser.add_argument("--checkpoint", default="checkpoint.pth.tar")
    parser.add_argument("--losses", default="")
    args = parser.parse_args()

    dist.init_process_group(backend="gloo")
    args.rank = dist.get_rank()
    torch.manual_seed(0)
    model = small_resnet()
    model = DDP(model)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    scheduler = StepLR(optimizer, step_size=1, gamma=0.5)

    train_dataset, val_dataset = images(128, 1), images(32, 2)
    train_sampler = DistributedSampler(train_dataset)
    val_sampler = DistributedSampler(val_dataset, shuffle=False, drop_last=True)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                              pin_memory=False, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=args.batch_size, shuffle=False, num_workers=args.workers,
                            pin_memory=False, sampler=val_sampler)

    best_acc1, losses = 0.0, []
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        train(train_loader, model, criterion, optimizer, epoch, args, losses)
        acc1 = validate(val_loader, model, criterion, args)
        scheduler.step()
        is_best = acc1 > best_acc1
        best_acc1 = max(acc1, best_acc1)
        if args.rank == 0:
            save_checkpoint({
                "epoch": epoch + 1,
                "arch": "small_resnet",
                "state_dict": model.state_dict(),
                "best_acc1": best_acc1,
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
            }, is_best, args.checkpoint)
    if args.losses and args.rank == 0:
        with open(args.losses, "w") as file:
            json.dump(losses, file)
    dist.destroy_process_group()


def train(train_loader, model, criterion, optimizer, epoch, args, losses_seen):
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    progress = ProgressMeter(len(train_loader), [losses, top1], prefix=f"Epoch: [{epoch}]")
    model.train()
    for i, (images, target) in enumerate(train_loader):
        output = model(images)
        loss = criterion(output, target)
        acc1, = accuracy(output, target, topk=(1,))
        losses.update(loss.item(), images.size(0))
        top1.update(acc1[0], images.size(0))
        losses_seen.append(loss.item())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i % args.print_freq == 0:
            progress.display(i + 1)


def validate(val_loader, model, criterion, args):
    losses = AverageMeter("Loss", ":.4e")
    top1 = AverageMeter("Acc@1", ":6.2f")
    model.eval()
    with torch.no_grad():
        for images, target in val_loader:
            output = model(images)
            losses.update(criterion(output, target).item(), images.size(0))
            acc1, = accuracy(output, target, topk=(1,))
            top1.update(acc1[0], images.size(0))
    top1.all_reduce()
    print(f" * Acc@1 {top1.avg:.3f}", flush=True)
    return float(top1.avg)


def save_checkpoint(state, is_best, filename="checkpoint.pth.tar"):
    torch.save(state, filename)
    if is_best:
        shutil.copyfile(filename, os.path.join(os.path.dirname(filename), "model_best.pth.tar"))


class AverageMeter:
    """Computes and stores the average and current value"""

    def __init__(self, name, fmt=":f"):
        self.name, self.fmt = name, fmt
        self.reset()

    def reset(self):
        self.val = self.avg = self.sum = self.count = 0

    def update(self, val, n=1):
        self.val = val
        self.sum += val * n
        self.count += n
        self.avg = self.sum / self.count

    def all_reduce(self):
        total = torch.tensor([self.sum, self.count], dtype=torch.float32)
        dist.all_reduce(total, dist.ReduceOp.SUM, async_op=False)
        self.sum, self.count = total.tolist()
        self.avg = self.sum / self.count

    def __str__(self):
        fmtstr = "{name} {val" + self.fmt + "} ({avg" + self.fmt + "})"
        return fmtstr.format(**self.__dict__)


class ProgressMeter:
    def __init__(self, num_batches, meters, prefix=""):
        digits = len(str(num_batches))
        self.batch_fmtstr = "[{:" + str(digits) + "d}/" + str(num_batches) + "]"
        self.meters, self.prefix = meters, prefix

    def display(self, batch):
        entries = [self.prefix + self.batch_fmtstr.format(batch)]
        entries += [str(meter) for meter in self.meters]
        print("\t".join(entries), flush=True)


def accuracy(output, target, topk=(1,)):
    """Computes the accuracy over the k top predictions for the specified values of k"""
    with torch.no_grad():
        maxk = max(topk)
        batch_size = target.size(0)
        _, pred = output.topk(maxk, 1, True, True)
        pred = pred.t()
        correct = pred.eq(target.view(1, -1).expand_as(pred))
        return [correct[:k].reshape(-1).float().sum(0, keepdim=True).mul_(100.0 / batch_size) for k in topk]


if __name__ == "__main__":
    main()
