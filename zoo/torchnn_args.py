"""Rules over parameter names for the torch cases (:mod:`zoo.torchnn`): tiny arguments, flag values, inputs.

A class's dimensionality is the ``1d``/``2d``/``3d`` its name ends with (2 otherwise); an argument that is a
module or a tensor (``conv``, ``encoder_layer``, a quantized norm's ``weight``) is made when the case builds,
after torch was seeded, so the deferred oracle records it too.
"""

from __future__ import annotations

import inspect
import re
import types
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.nn import functional as F

from zoo.outcomes import Skipped

EMPTY = inspect.Parameter.empty


class Made:
    """An argument made at build time (a module, a tensor), named by its label in case names."""

    def __init__(self, label: str, make: Callable[[], Any]) -> None:
        self.label, self.make = label, make

    def __call__(self) -> Any:
        return self.make()


def dims(cls: type) -> int:
    match = re.search(r"([123])d$", cls.__name__)
    return int(match.group(1)) if match else 2


def _by_dims(kind: str, *args: Any) -> Callable[[type], Made]:
    """``conv`` of a ``ConvBn2d`` is a ``Conv2d``: the class's dimensionality picks the layer."""
    def made(cls: type) -> Made:
        layer = getattr(nn, f"{kind}{dims(cls)}d")
        return Made(layer.__name__, lambda: layer(*args))
    return made


def _parameter(kind: str) -> Callable[[type], Made]:
    """A quantized norm's own ``weight`` and ``bias`` (it assigns them as parameters)."""
    return lambda cls: Made(f"{kind}(4)", lambda: nn.Parameter(torch.randn(4) if kind == "randn" else torch.zeros(4)))


def _qat_qconfig(cls: type) -> Made:
    """torch's default QAT qconfig of the kind the class asks: embeddings' own, a dynamic module's memoryless one."""
    from torch.ao import quantization

    name = ("default_embedding_qat_qconfig" if "Embedding" in cls.__name__ else
            "default_dynamic_qat_qconfig" if ".dynamic." in cls.__module__ else "default_qat_qconfig")
    return Made(name, lambda: getattr(quantization, name))


# name -> tiny value, or a function of the class giving one. Required parameters take them; so do those in
# TINY_DEFAULTS, whose defaults are large (Transformer's widths) or leave the module unusable (None sizes).
SIZES: dict[str, Any] = {
    "in_features": 4, "in1_features": 4, "in2_features": 5, "out_features": 6,
    "in_channels": 4, "out_channels": 6, "kernel_size": 3,
    "num_features": 4, "num_channels": 4, "num_groups": 2, "normalized_shape": 4,
    "input_size": 4, "hidden_size": 6, "input_dim": 4, "hidden_dim": 6,
    "num_embeddings": 10, "embedding_dim": 4,
    "embed_dim": 8, "num_heads": 2, "d_model": 8, "nhead": 2, "dim_feedforward": 12,
    "num_layers": 2, "num_encoder_layers": 1, "num_decoder_layers": 1,
    "n_classes": 6, "cutoffs": [2, 4], "num_classes": 6,
    "output_size": 2, "scale_factor": 2.0, "padding": 1, "value": 0.5, "threshold": 0.1,
    "upscale_factor": 2, "downscale_factor": 2, "groups": 2, "norm_type": 2.0, "size": 2,
    "dim": 1, "unflattened_size": (2, 2),
    "mode": "LSTM", "num_chunks": 4, "bias": True,
    "scale": 0.1, "zero_point": 0, "output_scale": 0.1, "output_zero_point": 0, "dtype": torch.quint8,
    "negative_slope": 0.01, "row_block_size": 1, "col_block_size": 4,
    "encoder_layer": lambda cls: Made("TransformerEncoderLayer", lambda: nn.TransformerEncoderLayer(8, 2, 12)),
    "decoder_layer": lambda cls: Made("TransformerDecoderLayer", lambda: nn.TransformerDecoderLayer(8, 2, 12)),
    "module": lambda cls: Made("Linear", lambda: nn.Linear(4, 6)),
    "linear": lambda cls: Made("Linear", lambda: nn.Linear(4, 6)),
    "conv": _by_dims("Conv", 4, 6, 3),
    "bn": _by_dims("BatchNorm", 6),
    "batch_norm": _by_dims("BatchNorm", 4),
    "relu": lambda cls: Made("ReLU", nn.ReLU),
    "leaky_relu": lambda cls: Made("LeakyReLU", nn.LeakyReLU),
    "tanh": lambda cls: Made("Tanh", nn.Tanh),
    "add": torch.add,
    "weight": _parameter("randn"),
    "bias_tensor": _parameter("zeros"),
    "qconfig": _qat_qconfig,
}
TINY_DEFAULTS = {"d_model", "nhead", "dim_feedforward", "num_layers", "num_encoder_layers", "num_decoder_layers",
                 "output_size", "scale_factor", "qconfig"}

# Flags that only say how a forward computes what it returns, not what the module holds or returns.
FORWARD_ONLY = frozenset({"inplace", "size_average", "reduce"})

# Flags beyond booleans: name -> (the variant's value, the default it replaces).
FLAG_VALUES: dict[str, tuple[Any, Any]] = {
    "padding_mode": ("circular", "zeros"),
    "nonlinearity": ("relu", "tanh"),
    "approximate": ("tanh", "none"),
    "mode": ("max", "mean"),
    "proj_size": (3, 0),
    "padding_idx": (0, None),
    "kdim": (5, None),
    "vdim": (7, None),
    "max_norm": (1.0, None),
    "groups": (2, 1),
    "momentum": (None, 0.1),
    "num_parameters": (4, 1),
    "bias": (True, None),
    "norm": (Made("LayerNorm", lambda: nn.LayerNorm(8)), None),
    "activation": ("gelu", F.relu),
    "reduction": ("sum", "mean"),
    "dtype": (torch.float16, torch.qint8),
}


def describe(value: Any) -> str:
    if isinstance(value, Made):
        return value.label
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    return getattr(value, "__name__", None) or str(value)


def arguments(cls: type, params: list[inspect.Parameter], flag_values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments a case passes (made ones still :class:`Made`); :class:`Skipped` where a required
    parameter has no rule."""
    kwargs: dict[str, Any] = {}
    for p in params:
        if p.name in flag_values:
            kwargs[p.name] = flag_values[p.name]
            continue
        if p.name.startswith("_") or (p.default is not EMPTY and p.name not in TINY_DEFAULTS):
            continue
        key = "bias_tensor" if p.name == "bias" and "weight" in {q.name for q in params} else p.name
        if key not in SIZES:
            if p.default is not EMPTY:
                continue
            raise Skipped(f"no rule gives {cls.__name__}'s required argument {p.name!r}")
        rule = SIZES[key]
        kwargs[p.name] = rule(cls) if isinstance(rule, types.FunctionType) else rule
    return kwargs


def _quantized_inputs(label: str) -> bool:
    """Static quantized modules take quantized tensors (dynamic and reference ones take floats, as ``Quantize``)."""
    parts = label.split(".")
    return "quantized" in parts and "dynamic" not in parts and "reference" not in parts and parts[-1] != "Quantize"


def _required_positional(cls: type) -> Optional[list[str]]:
    try:
        params = list(inspect.signature(cls.forward).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in params if p.default is EMPTY and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]


def make_input(cls: type, label: str, kwargs: dict[str, Any]) -> Optional[tuple]:
    """A tiny input for the forward, by rules over the arguments; ``None`` where no rule fits."""
    g = torch.Generator().manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    first = kwargs.get("batch_first") is True
    seq = lambda s, b, f: randn(b, s, f) if first else randn(s, b, f)  # noqa: E731
    required = _required_positional(cls)
    if required is None:
        return None
    if "embed_dim" in kwargs and required[:3] == ["query", "key", "value"]:
        e = kwargs["embed_dim"]
        found = (seq(3, 2, e), seq(4, 2, kwargs.get("kdim") or e), seq(4, 2, kwargs.get("vdim") or e))
    elif "d_model" in kwargs or "encoder_layer" in kwargs or "decoder_layer" in kwargs:
        d = 8
        shapes = {"src": (3, 2, d), "tgt": (4, 2, d), "memory": (3, 2, d)}
        if not set(required) <= shapes.keys():
            return None
        found = tuple(seq(*shapes[name]) for name in required)
    elif ("input_size" in kwargs or "input_dim" in kwargs) and len(required) == 1:
        features = kwargs.get("input_size", kwargs.get("input_dim"))
        found = (randn(2, features),) if cls.__name__.endswith("Cell") else (seq(3, 2, features),)
    elif required == ["input1", "input2"] and "in1_features" in kwargs:
        found = (randn(2, kwargs["in1_features"]), randn(2, kwargs["in2_features"]))
    elif len(required) == 1:
        found = (_one_input(cls, kwargs, randn, g),)
    else:
        return None
    if _quantized_inputs(label):
        found = tuple(torch.quantize_per_tensor(t, 0.05, 128, torch.quint8) if t.is_floating_point() else t
                      for t in found)
    return found


def _one_input(cls: type, kwargs: dict[str, Any], randn, g: torch.Generator) -> torch.Tensor:
    spatial = [6] * dims(cls)
    if "num_embeddings" in kwargs:
        return torch.randint(0, kwargs["num_embeddings"], (2, 3), generator=g)
    if "in_features" in kwargs or "linear" in kwargs or (cls.__name__ == "LazyLinear"):
        return randn(2, kwargs.get("in_features", 4))
    if "normalized_shape" in kwargs:
        return randn(2, 3, kwargs["normalized_shape"])
    channels = kwargs.get("in_channels", kwargs.get("num_features", kwargs.get("num_channels", 4)))
    return randn(2, channels, *spatial)
