"""The environment the suite runs in is the one the project says it is: locked for make test, at the claimed
floors for make test-oldest (see the Makefile and requirements-*.txt)."""

import os
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # make test-oldest's Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SELF = "torch-materialize"


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pins(path: Path) -> dict[str, str]:
    """name -> version of each ``name==version`` line (comments and other lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        found = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)", line)
        if found:
            pins[_normalized(found.group(1))] = found.group(2)
    return pins


def _declared() -> list[Requirement]:
    """Every dependency pyproject.toml declares, the hf extra's included."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = [r for extra in project["optional-dependencies"].values() for r in extra]
    return [Requirement(r) for r in list(project["dependencies"]) + extras]


def _floors() -> dict[str, Version]:
    """name -> lower bound of each declared dependency (back-ports for older Pythons, as tomli, left out)."""
    floors = {}
    for requirement in _declared():
        if requirement.marker is not None:
            continue
        bounds = [Version(s.version) for s in requirement.specifier if s.operator == ">="]
        assert bounds, f"pyproject.toml: {requirement} has no lower bound"
        floors[_normalized(requirement.name)] = bounds[0]
    return floors


def test_every_installed_package_is_at_its_locked_version():
    lock = os.environ.get("MATERIALIZE_LOCK")
    if not lock:
        pytest.skip("not the locked environment (make test sets MATERIALIZE_LOCK; test-latest and test-oldest do not)")
    pinned = _pins(ROOT / lock)
    installed = {_normalized(d.metadata["Name"]): d.version for d in metadata.distributions()}
    installed.pop("pip", None)  # the venv's own, as the lock says
    installed.pop(SELF, None)

    assert {name: version for name, version in installed.items() if pinned.get(name) != version} == {}


def test_the_oldest_environment_pins_every_dependency_at_the_floor_pyproject_claims():
    # The first run of make test-oldest holds the core's floors; the second adds the hf extra's (transformers).
    floors, core, hf = _floors(), _pins(ROOT / "requirements-oldest.txt"), _pins(ROOT / "requirements-oldest-hf.txt")
    oldest = {**{name: version for name, version in hf.items() if name not in core}, **core}

    assert {name: oldest.get(name) for name in floors  # 0.25 is 0.25.0
            if name not in oldest or Version(oldest[name]) != floors[name]} == {}
    assert "transformers" not in core and Version(hf["transformers"]) == floors["transformers"]


def test_the_lock_holds_every_dependency_pyproject_declares_within_its_range():
    lock_text = (ROOT / "requirements-lock.txt").read_text()
    locked = _pins(ROOT / "requirements-lock.txt")
    python = re.search(r"Python (\d+\.\d+)", lock_text).group(1)  # markers as on the lock's Python, not this one's
    outside = {r.name: locked.get(_normalized(r.name)) for r in _declared()
               if (r.marker is None or r.marker.evaluate({"python_version": python}))
               and not (locked.get(_normalized(r.name)) and r.specifier.contains(locked[_normalized(r.name)].split("+")[0]))}

    assert outside == {}
