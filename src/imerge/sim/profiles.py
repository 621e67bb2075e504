"""A model as the simulator sees it: its units (one module's parameters each, in backward order) with their
forward and backward seconds. Pure.

Profiles come from a worker (``imerge worker --profile-out FILE``: measured on
the job's own hardware), from the files of the built-in models measured once
(``imerge.sim/share/``), or from the layer shapes of standard architectures
(:func:`synthetic`), timed at a given device throughput (FLOPs / rate; a
backward costs twice its forward).
"""
from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

from imerge.core.errors import ConfigError
from imerge.core.planning import BYTES_PER_ELEMENT, Layout, ParamInfo

PROFILE_FORMAT = "imerge-profile/1"


@dataclasses.dataclass(frozen=True)
class UnitProfile:
    module: str
    numel: int
    forward_s: float
    backward_s: float
    group: int = 0  # the optimizer parameter group


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    name: str
    units: tuple[UnitProfile, ...]  # backward order: the last layer first
    alpha_s: float = 0.0            # the push cost the worker fitted (for fusion cost; 0: not measured)
    beta_s_per_byte: float = 0.0
    # the units' groups under fusion cost where they are known: a job deciding its own schedule (the coordinator's
    # cost plan from the measured profile, which a simulated cost plan must equal); None: the simulated worker 0's
    cost_groups: tuple[tuple[int, ...], ...] | None = None

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def nbytes(self) -> int:
        return self.numel * BYTES_PER_ELEMENT

    @property
    def compute_s(self) -> float:
        return sum(u.forward_s + u.backward_s for u in self.units)

    def layout(self) -> Layout:
        """A layout with one parameter per unit: it plans the same units, blocks and groups as the model's own."""
        return Layout(tuple(ParamInfo(u.module, (u.numel,), u.module, u.group) for u in self.units))

    def scaled(self, compute_s: float) -> "ModelProfile":
        """The same model with every time scaled so that forward plus backward take ``compute_s``."""
        factor = compute_s / self.compute_s if self.compute_s else 0.0
        return dataclasses.replace(self, units=tuple(
            dataclasses.replace(u, forward_s=u.forward_s * factor, backward_s=u.backward_s * factor)
            for u in self.units))

    def to_json(self) -> str:
        return json.dumps({"format": PROFILE_FORMAT, "name": self.name, "alpha_s": self.alpha_s,
                           "beta_s_per_byte": self.beta_s_per_byte,
                           "units": [[u.module, u.numel, u.group, u.forward_s, u.backward_s] for u in self.units]},
                          indent=1)

    def write(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json(), encoding="utf-8")

    @classmethod
    def from_json(cls, text: str, source: str = "profile") -> "ModelProfile":
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError("profile", f"{source} is not JSON: {exc}") from None
        if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT:
            raise ConfigError("profile", f"{source} is not an IMerge profile (format {PROFILE_FORMAT}); write one "
                                         "with imerge worker --profile-out FILE")
        units: list[UnitProfile] = []
        for index, entry in enumerate(raw.get("units") or []):
            try:
                module, numel, group, forward_s, backward_s = entry
                unit = UnitProfile(str(module), int(numel), float(forward_s), float(backward_s), int(group))
            except (TypeError, ValueError):
                raise ConfigError("profile", f"{source}: unit #{index} is not [module, numel, group, forward_s, "
                                             f"backward_s]: {str(entry)[:80]}") from None
            if unit.numel < 1 or not (unit.forward_s >= 0 and unit.backward_s >= 0) \
                    or not math.isfinite(unit.forward_s + unit.backward_s):
                raise ConfigError("profile", f"{source}: unit #{index} ({unit.module}) needs numel >= 1 and finite "
                                             "times >= 0")
            if units and (units[-1].module, units[-1].group) == (unit.module, unit.group):
                raise ConfigError("profile", f"{source}: units #{index - 1} and #{index} are both {unit.module} "
                                             f"(group {unit.group}): one unit per module and parameter group")
            units.append(unit)
        if not units:
            raise ConfigError("profile", f"{source} lists no units")
        cost = {}
        for key in ("alpha_s", "beta_s_per_byte"):  # the push cost the worker fitted
            try:
                cost[key] = float(raw.get(key, 0.0))
            except (TypeError, ValueError):
                cost[key] = math.nan
            if not (math.isfinite(cost[key]) and cost[key] >= 0):
                raise ConfigError("profile", f"{source}: {key} must be a finite number >= 0, not {raw.get(key)!r}")
        return cls(str(raw.get("name") or Path(source).stem), tuple(units), cost["alpha_s"], cost["beta_s_per_byte"])

    @classmethod
    def read(cls, path: str | Path) -> "ModelProfile":
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigError("profile", f"cannot read {path}: {exc.strerror}") from None
        return cls.from_json(text, str(path))


def from_measurement(name: str, modules: list[tuple[str, int, int]], forward_s: list[float],
                     backward_s: list[float], alpha_s: float = 0.0, beta_s_per_byte: float = 0.0) -> ModelProfile:
    """A profile from a worker's measurement: ``modules`` lists each unit's (module, numel, group)."""
    units = tuple(UnitProfile(m, n, f, b, g) for (m, n, g), f, b in zip(modules, forward_s, backward_s))
    return ModelProfile(name, units, alpha_s, beta_s_per_byte)


# -- built-in profiles --------------------------------------------------------------------------
def measured(name: str) -> ModelProfile:
    """A built-in model's profile measured once on this project's machine (``imerge.sim/share/NAME.json``)."""
    path = resources.files("imerge.sim").joinpath("share", f"{name}.json")
    if not path.is_file():
        raise ConfigError("model", f"no measured profile of {name!r}; measured: {', '.join(MEASURED)}")
    return ModelProfile.from_json(path.read_text(encoding="utf-8"), name)


MEASURED = ("resnet18", "vgg", "digits-cnn")  # the built-in job's models (imerge.workloads), as the testbed runs them


@dataclasses.dataclass(frozen=True)
class Layer:
    module: str
    numel: int
    flops: float  # forward FLOPs per sample


def _conv(name: str, cin: int, cout: int, k: int, side: int, bn: bool = True) -> Iterator[Layer]:
    yield Layer(name, k * k * cin * cout, 2.0 * k * k * cin * cout * side * side)
    if bn:
        yield Layer(f"{name}.bn", 2 * cout, 4.0 * cout * side * side)


def resnet_layers(depth: int, classes: int = 1000) -> list[Layer]:
    """ResNet-18/34 (basic blocks) or -50/101/152 (bottlenecks) on 224x224 images, in forward order."""
    blocks = {18: (2, 2, 2, 2), 34: (3, 4, 6, 3), 50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3)}[depth]
    bottleneck = depth >= 50
    layers = list(_conv("conv1", 3, 64, 7, 112))
    cin, side = 64, 56
    for stage, count in enumerate(blocks):
        width = 64 << stage
        cout = width * 4 if bottleneck else width
        for index in range(count):
            name = f"layer{stage + 1}.{index}"
            stride_side = side // 2 if (index == 0 and stage > 0) else side
            if bottleneck:
                layers += _conv(f"{name}.conv1", cin, width, 1, side)
                layers += _conv(f"{name}.conv2", width, width, 3, stride_side)
                layers += _conv(f"{name}.conv3", width, cout, 1, stride_side)
            else:
                layers += _conv(f"{name}.conv1", cin, width, 3, stride_side)
                layers += _conv(f"{name}.conv2", width, width, 3, stride_side)
            if index == 0 and (cin != cout or stage > 0):
                layers += _conv(f"{name}.downsample", cin, cout, 1, stride_side)
            cin, side = cout, stride_side
    layers.append(Layer("fc", cin * classes + classes, 2.0 * cin * classes))
    return layers


def vgg16_layers(classes: int = 1000) -> list[Layer]:
    plan: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]
    layers, cin, side = [], 3, 224
    for index, item in enumerate(plan):
        if isinstance(item, str):  # "M": a max pool halves the side
            side //= 2
            continue
        layers.append(Layer(f"features.{index}", 9 * cin * item + item, 2.0 * 9 * cin * item * side * side))
        cin = item
    for index, (fan_in, fan_out) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, classes)]):
        layers.append(Layer(f"classifier.{index}", fan_in * fan_out + fan_out, 2.0 * fan_in * fan_out))
    return layers


def transformer_layers(blocks: int = 12, width: int = 768, tokens: int = 128, vocab: int = 30522) -> list[Layer]:
    """A BERT-base-like stack: embeddings, then per block attention (qkv, output) and MLP (4x), LayerNorms."""
    layers = [Layer("embeddings", vocab * width + 512 * width, 0.0)]
    for index in range(blocks):
        name = f"block{index}"
        layers += [Layer(f"{name}.attn.qkv", 3 * width * width + 3 * width, 2.0 * 3 * width * width * tokens
                         + 4.0 * tokens * tokens * width),
                   Layer(f"{name}.attn.out", width * width + width, 2.0 * width * width * tokens),
                   Layer(f"{name}.ln1", 2 * width, 8.0 * width * tokens),
                   Layer(f"{name}.mlp.fc1", 4 * width * width + 4 * width, 8.0 * width * width * tokens),
                   Layer(f"{name}.mlp.fc2", 4 * width * width + width, 8.0 * width * width * tokens),
                   Layer(f"{name}.ln2", 2 * width, 8.0 * width * tokens)]
    layers.append(Layer("head", width * width + width, 2.0 * width * width * tokens))
    return layers


SYNTHETIC: dict[str, Callable[[], list[Layer]]] = {
    "resnet18-like": lambda: resnet_layers(18),
    "resnet50-like": lambda: resnet_layers(50),
    "vgg16-like": vgg16_layers,
    "transformer-like": transformer_layers,
}


def synthetic(name: str, batch_size: int, device_tflops: float) -> ModelProfile:
    """A standard architecture's layers, timed at ``device_tflops`` (sustained) for ``batch_size`` samples."""
    if name not in SYNTHETIC:
        raise ConfigError("model", f"unknown model {name!r}; choose from {', '.join([*SYNTHETIC, *MEASURED])} or "
                                   "give --profile FILE")
    rate = device_tflops * 1e12
    forward = list(SYNTHETIC[name]())
    units = tuple(UnitProfile(layer.module, layer.numel, layer.flops * batch_size / rate,
                              2.0 * layer.flops * batch_size / rate) for layer in reversed(forward))
    return ModelProfile(name, units)
