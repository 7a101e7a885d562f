"""The wheel the README tells a newcomer to build: made from the checkout, installed into a fresh venv, run.

The fresh venv gets the wheel alone (``--no-deps``); its dependencies come from this environment's
site-packages through a ``.pth`` line, so nothing is downloaded. The checkout is never on its path: the
commands run from an empty folder, and ``materialize`` must be imported from the venv's own site-packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
if sys.version_info >= (3, 11):
    import tomllib
else:  # make test-oldest's Python 3.10
    import tomli as tomllib

# What git ignores, and what no build needs: copied, they would only cost time.
NOT_BUILT_FROM = shutil.ignore_patterns(".git", ".venv*", "data", "build", "dist", "site", "*.egg-info", "__pycache__",
                                        ".pytest_cache", "fuzz_findings")


def _run(*args: object, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the wheel, the fresh venv it is installed in)."""
    work = tmp_path_factory.mktemp("wheel")
    source = work / "source"  # a copy: a build writes build/ and *.egg-info into the tree it builds
    shutil.copytree(ROOT, source, ignore=NOT_BUILT_FROM, symlinks=True)
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                 "-w", work / "dist", source, cwd=work)
    assert built.returncode == 0, built.stdout + built.stderr
    [wheel] = (work / "dist").glob("torch_materialize-*.whl")

    venv = work / "venv"
    made = _run(sys.executable, "-m", "venv", "--without-pip", venv, cwd=work)
    assert made.returncode == 0, made.stderr
    done = _run(sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "--no-index",
                wheel, cwd=work)
    assert done.returncode == 0, done.stdout + done.stderr
    site = Path(_run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
                     cwd=work).stdout.strip())
    # This environment's site-packages (and those its own .pth files chain in), the checkout left out.
    dependencies = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages") and Path(p).is_dir()]
    (site / "dependencies.pth").write_text("\n".join(dependencies) + "\n")
    return wheel, venv


def _clean_env() -> dict:
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}


def test_the_wheel_holds_every_module_of_both_packages(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())

    expected = {str(p.relative_to(ROOT)) for p in (ROOT / "materialize").rglob("*.py")}
    expected |= {"materialize_cli/" + p.name for p in (ROOT / "cli").glob("*.py")}
    assert expected <= names, sorted(expected - names)
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "materialize = materialize_cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_command_loads_and_inspects_from_the_venv_not_the_checkout(installed, tmp_path):
    _, venv = installed
    path = tmp_path / "model.safetensors"
    save_file({"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5, dtype=torch.bfloat16)},
              str(path))
    command = venv / "bin" / "materialize"

    where = _run(venv / "bin" / "python", "-c", "import materialize, materialize_cli; "
                 "print(materialize.__file__); print(materialize_cli.__file__)", cwd=tmp_path, env=_clean_env())
    loaded = _run(command, path, "--json", cwd=tmp_path, env=_clean_env())
    inspected = _run(command, "inspect", path, "--json", cwd=tmp_path, env=_clean_env())
    version = _run(command, "--version", cwd=tmp_path, env=_clean_env())

    assert where.returncode == 0, where.stderr
    assert all(Path(line).is_relative_to(venv) for line in where.stdout.split()), where.stdout
    assert loaded.returncode == 0, loaded.stderr
    report = json.loads(loaded.stdout)
    assert sorted(report["loaded"]) == ["b", "w"] and report["bytes_read"] == 12 * 4 + 5 * 2
    assert inspected.returncode == 0, inspected.stderr
    summary = json.loads(inspected.stdout)
    assert {t["name"]: (t["dtype"], t["shape"]) for t in summary["tensors"]} == {
        "w": ("float32", [3, 4]), "b": ("bfloat16", [5])}
    assert version.returncode == 0, version.stderr
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert version.stdout.split()[-1] == project["version"]
