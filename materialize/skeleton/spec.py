"""Model specs: the forms a skeleton can be described in.

* a callable returning a module (a class, a factory function);
* ``"package.module:callable"`` (an importable module);
* ``"path/to/file.py:callable"`` (a Python file, for a model defined in a
  script beside the checkpoint: the file runs as a module named after it,
  its folder first on the import path while it runs, as running the
  script would put it; relative paths start at the working directory, or
  at a TOML file's folder for its ``factory``). Naming the file is asking
  for its code to run, as naming a module is; a file already imported
  (under any module name) is not run twice;
* ``"timm:NAME"``, ``"torchvision:NAME"``;
* a TOML file in the ``configs/`` format::

      [model]
      factory = "../bench/models/transformer.py:DecoderLM"

      [model.args]
      hidden_size = 1024

Whatever the form, the model is built under :func:`meta_init`, so its
parameters cost no memory and its buffers are real.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any, Optional, Union

from torch import nn

from ..errors import (MaterializeError, MaterializeWarning, MetaInitError, ModelSpecError, ModelSpecUsageError, first_line,
                      torchvision_mismatch)
from .deferred import deferred_init
from .meta import meta_init
from .provenance import remember_built

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

ModelSpec = Union[str, os.PathLike, Callable[..., nn.Module]]


def read_config(path: Union[str, os.PathLike]) -> dict[str, Any]:
    """Read a ``configs/`` TOML file."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise ModelSpecError("no such config file", path=path) from None
    except tomllib.TOMLDecodeError as exc:
        raise ModelSpecError(f"invalid TOML: {exc}", path=path) from None


def resolve_factory(spec: ModelSpec) -> tuple[Callable[..., nn.Module], dict[str, Any]]:
    """The callable a spec names and the arguments its config file gives."""
    if callable(spec):
        return spec, {}
    text = os.fspath(spec)
    family, _, name = text.partition(":")
    if family in MODEL_FAMILIES and name:
        return MODEL_FAMILIES[family](name), {}
    if text.endswith(".toml") or Path(text).is_file():
        config = read_config(text)
        model = config.get("model")
        if not isinstance(model, dict) or not isinstance(model.get("factory"), str):
            raise ModelSpecError("needs a [model] table with factory = \"package.module:callable\"", path=text)
        args = model.get("args", {})
        if not isinstance(args, dict):
            raise ModelSpecError("[model.args] must be a table", path=text)
        return _import_callable(model["factory"], relative_to=Path(text).parent), dict(args)
    return _import_callable(text), {}


def _timm(name: str) -> Callable[..., nn.Module]:
    def create(**args: Any) -> nn.Module:
        timm = _import_family("timm", "timm")
        if not timm.is_model(name):
            raise ModelSpecUsageError(f"timm has no model {name!r} (timm.list_models() lists them)")
        return timm.create_model(name, **{"pretrained": False, **args})

    create.__qualname__ = f"timm.create_model({name!r})"
    return create


def _torchvision(name: str) -> Callable[..., nn.Module]:
    def create(**args: Any) -> nn.Module:
        models = _import_family("torchvision", "torchvision.models")
        if name not in models.list_models():
            raise ModelSpecUsageError(f"torchvision has no model {name!r} (torchvision.models.list_models() lists them)")
        return models.get_model(name, **{"weights": None, **args})

    create.__qualname__ = f"torchvision.models.get_model({name!r})"
    return create


def _import_family(package: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ModelSpecUsageError(f"'{package}:' models need {package} installed (pip install {package}): {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a build that does not fit the installed torch fails on import
        raise ModelSpecError(
            f"{package} cannot be imported here: {type(exc).__name__}: {first_line(exc)}{torchvision_mismatch(exc)}"
        ) from None


# "family:name" model specs: the family's own factory, given --model-arg values, never downloading weights
# (pretrained=False, weights=None unless asked): the checkpoint is what the load reads.
MODEL_FAMILIES: dict[str, Callable[[str], Callable[..., nn.Module]]] = {"timm": _timm, "torchvision": _torchvision}


def _import_callable(target: str, *, relative_to: Optional[Path] = None) -> Callable[..., nn.Module]:
    module_name, sep, attr_path = target.rpartition(":")
    if not sep or not module_name or not attr_path:
        raise ModelSpecUsageError(
            f"model spec {target!r} must be 'package.module:callable', 'path/to/file.py:callable' or a .toml config file"
        )
    obj: Any
    if module_name.endswith(".py"):
        obj = _module_from_file((relative_to or Path.cwd()) / module_name, target)
    else:
        try:
            obj = importlib.import_module(module_name)
        except ImportError as exc:
            raise ModelSpecUsageError(
                f"model spec {target!r}: cannot import {module_name!r} ({exc}){_as_file_hint(module_name, attr_path)}"
            ) from None
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ModelSpecUsageError(f"model spec {target!r}: {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ModelSpecUsageError(f"model spec {target!r} is not callable")
    return obj


def _as_file_hint(module_name: str, attr_path: str) -> str:
    """A module that is a file here but not on the import path (a console script does not put the working
    directory there, as ``python -m`` does) can be named as that file."""
    candidate = Path(*module_name.split(".")).with_suffix(".py")
    return f"; {candidate} is here: name it as the file, '{candidate}:{attr_path}'" if candidate.is_file() else ""


def _module_from_file(path: Path, target: str) -> ModuleType:
    """The module a Python file defines, run once (see the module docstring)."""
    if not path.is_file():
        raise ModelSpecUsageError(f"model spec {target!r}: no such file {path}")
    resolved = path.resolve()
    for module in list(sys.modules.values()):
        known = getattr(module, "__file__", None)  # by name first: resolving every module's path costs a stat each
        if known and os.path.basename(known) == resolved.name and Path(known).resolve() == resolved:
            return module
    name = f"materialize_model_file_{hashlib.sha1(str(resolved).encode()).hexdigest()[:12]}_{resolved.stem}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ModelSpecUsageError(f"model spec {target!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here while it runs
    sys.path.insert(0, str(resolved.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        if not isinstance(exc, Exception):
            raise
        raise ModelSpecError(f"model spec {target!r}: the file failed to run: {type(exc).__name__}: {first_line(exc)}",
                             path=path) from None
    finally:
        sys.path.remove(str(resolved.parent))
    return module


def build(spec: ModelSpec, **kwargs: Any) -> nn.Module:
    """Build a model skeleton on ``meta`` from a spec; ``kwargs`` override config args.

    A folder holding a Hugging Face ``config.json``, or a hub repo id
    (``org/name``), builds its transformers model (needs the ``hf`` extra).
    """
    if not callable(spec):
        from ..integrations.hub import looks_like_repo_id, resolve

        if looks_like_repo_id(spec) and not os.fspath(spec).endswith(".toml"):
            spec = resolve(spec)
    if not callable(spec) and Path(os.fspath(spec)).is_dir():
        from .hfbuild import build_hf, is_hf_folder

        if not is_hf_folder(Path(os.fspath(spec))):
            raise ModelSpecError("is a folder without config.json: not a model spec", path=spec)
        return build_hf(Path(os.fspath(spec)))
    factory, args = resolve_factory(spec)
    args.update(kwargs)
    with meta_init():
        return remember_built(_called(factory, lambda: factory(**args)), spec, factory, args)


def build_recorded(spec: ModelSpec, **kwargs: Any) -> nn.Module:
    """:func:`build`, under :func:`~materialize.skeleton.deferred.deferred_init` instead of :func:`meta_init`:
    a load then makes what the checkpoint lacks as eager construction made it.

    A constructor that cannot be recorded (it asks a tensor's value) is
    built as :func:`build` builds it, with a warning saying so: what the
    checkpoint lacks is then initialized by ``reset_parameters()``.
    """
    factory, args = resolve_factory(spec)
    args.update(kwargs)
    try:
        return remember_built(_called(factory, lambda: deferred_init(factory, **args)), spec, factory, args)
    except MetaInitError as exc:
        warnings.warn(MaterializeWarning(
            f"{first_line(exc)}; built without recording: tensors the checkpoint lacks are initialized by their "
            "modules' reset_parameters()"), stacklevel=2)
    with meta_init():
        return remember_built(_called(factory, lambda: factory(**args)), spec, factory, args)


def _called(factory: Callable[..., nn.Module], construct: Callable[[], Any]) -> nn.Module:
    """``construct()``, its failures named by the factory."""
    name = getattr(factory, "__qualname__", factory)
    try:
        model = construct()
    except TypeError as exc:
        raise ModelSpecUsageError(f"model factory {name!r} rejected its arguments: {exc}") from None
    except MaterializeError:
        raise
    except Exception as exc:  # the factory's own failure (a download attempted offline, say): say where and why
        raise ModelSpecError(
            f"model factory {name!r} failed while building the model: {type(exc).__name__}: {first_line(exc)}"
        ) from None
    if not isinstance(model, nn.Module):
        raise ModelSpecError(f"model factory {getattr(factory, '__qualname__', factory)!r} returned {type(model).__name__}, not an nn.Module")
    return model
