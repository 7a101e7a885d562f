"""Every case of the zoo by name (``library/oracle/model``), and the one function that runs a case.

The libraries list the cases: transformers' auto mappings, timm's families, torchvision's builders (see
:mod:`zoo.hf` and :mod:`zoo.vision`). Each library has two oracles: ``deferred`` (:mod:`zoo.deferred`) and
``load`` (:mod:`zoo.pretrained` for transformers, :mod:`zoo.vision_load` for timm and torchvision).
A case returns notes when it passes and raises otherwise: :class:`zoo.outcomes.Skipped` where eager
construction itself fails, :class:`zoo.outcomes.Different` with the differences, a ``MaterializeError``
where materialize refuses, anything else where materialize breaks.
"""

from __future__ import annotations

from pathlib import Path

LIBRARIES = ("hf", "timm", "torchvision")
ORACLES = ("deferred", "load")


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
    from zoo import vision

    build = vision.factory(library, model)
    if oracle == "deferred":
        from zoo import deferred

        return deferred.check(build, folder)
    from zoo import vision_load

    return vision_load.check(library, model, folder)
