"""Every case of the zoo by name (``library/oracle/model``), and the one function that runs a case.

The libraries list the cases: transformers' auto mappings, timm's families, torchvision's builders (see
:mod:`zoo.hf` and :mod:`zoo.vision`). Each library has two oracles: ``deferred`` (:mod:`zoo.deferred`) and
``load`` (:mod:`zoo.pretrained` for transformers, :mod:`zoo.vision_load` for timm and torchvision).
torch's own families (:data:`TORCH_FAMILIES`) list and run their cases themselves: every ``torch.nn`` and
``torch.ao.nn`` module at its flags and parametrizations (:mod:`zoo.torchnn`, both oracles), every
``torch.linalg`` function in a constructor (:mod:`zoo.linalg`, deferred) and each kind of load code
(:mod:`zoo.loadcode`, load).
peft and diffusers list and run theirs too: every peft tuner type on a tiny Llama (:mod:`zoo.peft_cases`;
its load cases are ``TYPE/adapter``, ``TYPE/whole``, ``TYPE/merged``), every diffusers ``ModelMixin`` class at
a tiny config (:mod:`zoo.diffusers_cases`).
A case returns notes when it passes and raises otherwise: :class:`zoo.outcomes.Skipped` where eager
construction itself fails, :class:`zoo.outcomes.Different` with the differences, a ``MaterializeError``
where materialize refuses, anything else where materialize breaks.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

LIBRARIES = ("hf", "timm", "torchvision", "peft", "diffusers", "torch", "linalg", "loadcode")
ORACLES = ("deferred", "load")
# Libraries of torch itself, each a module with case_models() ((oracle, model) pairs) and run_case(oracle, model, folder).
TORCH_FAMILIES = {"torch": "zoo.torchnn", "linalg": "zoo.linalg", "loadcode": "zoo.loadcode"}


def case_names(libraries: tuple[str, ...] = LIBRARIES) -> list[str]:
    names = []
    if "hf" in libraries:
        from zoo.hf import registered_classes

        names += [f"hf/{oracle}/{cls}" for cls in registered_classes() for oracle in ORACLES]
    if "timm" in libraries:
        from zoo.vision import timm_families

        names += [f"timm/{oracle}/{model}" for model in sorted(set(timm_families().values())) for oracle in ORACLES]
    if "torchvision" in libraries:
        from zoo.vision import torchvision_builders

        names += [f"torchvision/{oracle}/{model}" for model in torchvision_builders() for oracle in ORACLES]
    if "peft" in libraries:
        from zoo.peft_cases import case_models

        names += [f"peft/{oracle}/{model}" for oracle, model in case_models()]
    if "diffusers" in libraries:
        from zoo.diffusers_cases import model_classes

        names += [f"diffusers/{oracle}/{cls}" for cls in model_classes() for oracle in ORACLES]
    for library in (name for name in TORCH_FAMILIES if name in libraries):
        names += [f"{library}/{oracle}/{model}" for oracle, model in import_module(TORCH_FAMILIES[library]).case_models()]
    return names


def split(case: str) -> tuple[str, str, str]:
    library, oracle, model = case.split("/", 2)
    return library, oracle, model


def run_case(case: str, folder: Path) -> list[str]:
    """Run one case in this process; ``folder`` is an empty scratch folder. Returns the notes of a pass."""
    library, oracle, model = split(case)
    if library == "hf":
        from zoo import hf

        build = hf.builder(model)
        if oracle == "deferred":
            from zoo import deferred

            return [f"config: {hf.describe_config(model)}", *deferred.check(build, folder)]
        from zoo import pretrained

        return [f"config: {hf.describe_config(model)}", *pretrained.check(build, folder, model)]
    if library in TORCH_FAMILIES:
        return import_module(TORCH_FAMILIES[library]).run_case(oracle, model, folder)
    if library == "peft":
        from zoo import peft_cases

        return peft_cases.run_case(oracle, model, folder)
    if library == "diffusers":
        from zoo import diffusers_cases

        return diffusers_cases.run_case(oracle, model, folder)
    from zoo import vision

    build = vision.factory(library, model)
    if oracle == "deferred":
        from zoo import deferred

        return deferred.check(build, folder)
    from zoo import vision_load

    return vision_load.check(library, model, folder)
