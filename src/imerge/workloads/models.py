"""Built-in models: ResNet-18 (CIFAR shapes), a communication-bound VGG-style net, a digits CNN, and a
communication-only stack of linear layers (for ``imerge bench datapath``)."""
from __future__ import annotations

import threading

import torch
from torch import nn

MODELS = ("resnet18", "vgg", "digits-cnn", "linear4")


class DigitsCNN(nn.Module):
    """A small CNN for the 8x8 handwritten digits that scikit-learn ships."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        out: torch.Tensor = self.fc2(torch.relu(self.fc1(x.flatten(1))))
        return out


class BasicBlock(nn.Module):
    def __init__(self, inputs: int, outputs: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut = nn.Sequential()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(nn.Conv2d(inputs, outputs, 1, stride, bias=False),
                                          nn.BatchNorm2d(outputs))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 3x32x32 inputs (CIFAR shapes): 11.2M parameters."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        layers, inputs = [], 64
        for outputs, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers.append(nn.Sequential(BasicBlock(inputs, outputs, stride), BasicBlock(outputs, outputs, 1)))
            inputs = outputs
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(torch.relu(self.bn1(self.conv1(x))))
        out: torch.Tensor = self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))
        return out


class VGGStyle(nn.Module):
    """Light convolutions and large fully connected layers: 8.9M parameters, communication-bound."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        channels, layers, inputs = (32, 64, 128), [], 3
        for outputs in channels:
            layers += [nn.Conv2d(inputs, outputs, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
            inputs = outputs
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Linear(128 * 4 * 4, 2048), nn.ReLU(), nn.Linear(2048, 2048),
                                        nn.ReLU(), nn.Linear(2048, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.classifier(self.features(x).flatten(1))
        return out


class Linear4(nn.Sequential):
    """4 x Linear(2048, 2048): 67 MB of parameters and almost no compute at batch 1 (the data path alone)."""

    def __init__(self, width: int = 2048):
        super().__init__(*[nn.Linear(width, width) for _ in range(4)])


_BUILD_LOCK = threading.Lock()
INPUT_SHAPES = {"resnet18": (3, 32, 32), "vgg": (3, 32, 32), "digits-cnn": (1, 8, 8), "linear4": (2048,)}


def build_model(name: str, seed: int = 0) -> nn.Module:
    """The named model, initialized from ``seed`` so every worker builds the same one."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    with _BUILD_LOCK, torch.random.fork_rng():  # seeding the global RNG is not thread-safe
        torch.manual_seed(seed)
        return {"resnet18": ResNet18, "vgg": VGGStyle, "digits-cnn": DigitsCNN, "linear4": Linear4}[name]()
