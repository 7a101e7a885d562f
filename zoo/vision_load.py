"""The vision oracle: ``mz.build("timm:NAME")`` + ``mz.load(model, file)`` is eager + ``load_state_dict`` of the file."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import materialize as mz
from zoo.differential import BUILD_SEED, compare_models, compare_outputs, forward, read, reference_load, seeded, \
    trained_state, write
from zoo.outcomes import Different, Skipped, one_line
from zoo.vision import factory, input_sides, make_input, model_args


def check(library: str, name: str, folder: Path) -> list[str]:
    build = factory(library, name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            state = trained_state(build)  # another seed, every tensor moved: the file differs from a fresh build
            reference = seeded(build, BUILD_SEED)
        except Exception as error:
            raise Skipped(f"eager construction fails: {one_line(error)}") from None
        folder.mkdir(parents=True, exist_ok=True)
        path = write(state, folder / "full.pt", "pt")
        outcome = reference_load(reference, read(path, "pt"), strict=True)
        if outcome.error is not None:
            raise Skipped(f"load_state_dict of its own state fails: {one_line(outcome.error)}")
        model = mz.build(f"{library}:{name}", **model_args(library, name))
        mz.load(model, path)
    found = compare_models(model, reference)
    notes = []
    last = ""
    for side in input_sides(library, name):  # outputs too, even where attributes differ
        inputs = make_input(library, name, side)
        try:
            expected = forward(reference, inputs)
        except Exception as error:
            last = one_line(error, 150)
            continue
        found += [f"[forward at {side}] {d}" for d in compare_outputs(forward(model, inputs), expected, "forward")]
        break
    else:
        notes.append(f"forward not compared: the reference's raises {last}")
    if found:
        raise Different(found)
    return notes
