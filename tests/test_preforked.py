"""tests/preforked.py against the oracle it stands in for: a real subprocess running the same command.

Every program below runs three ways (a script, ``-m``, ``-c``) through both, and what comes back must be the
same: exit status, standard output and error, byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import preforked
from test_cli import materialize_command, write_small_safetensors

@pytest.fixture(autouse=True)
def forking_on(monkeypatch):
    """These tests hold the fork itself to a real process, so they fork even where the run asks for real
    processes everywhere (make test-all's PREFORKED=0); the test of that switch sets it again."""
    monkeypatch.setenv("PREFORKED", "1")


PROGRAMS = {
    "output on both streams": 'print("out"); print("err", file=sys.stderr); print("é ✓")',
    "an exit status": "sys.exit(3)",
    "an exit message": 'sys.exit("bye")',
    "an exception's traceback": 'def failing():\n    raise ValueError("boom")\nfailing()',
    "a signal": "os.kill(os.getpid(), signal.SIGTERM)",
    "an interrupt": "raise KeyboardInterrupt",
    "argv, name, cwd, environment": 'print(sys.argv[1:], __name__, os.getcwd(), os.environ.get("PREFORKED_PROBE"))',
    "sys.path's head and a PYTHONPATH module": "import probe_module; print(sys.path[0], probe_module.VALUE)",
    "standard input": "print(sys.stdin.read().upper(), sys.stdin.isatty(), sys.stdout.isatty())",
    "atexit and a thread still running": textwrap.dedent("""\
        import atexit, threading, time
        atexit.register(print, "atexit ran")
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread ended"))).start()
        print("main ended")"""),
    "torch as a fresh process has it": textwrap.dedent("""\
        import torch
        print(torch.get_num_threads(), torch.initial_seed(), torch.get_default_dtype(), torch.rand(2).tolist())
        print("materialize" in sys.modules)"""),
}
PROLOGUE = "import os, signal, sys\n"


def _command(how: str, program: str, folder) -> list[str]:
    if how == "script":
        path = folder / "program.py"
        path.write_text(PROLOGUE + program)
        return [sys.executable, str(path), "an argument"]
    if how == "module":
        (folder / "program_module.py").write_text(PROLOGUE + program)
        return [sys.executable, "-m", "program_module", "an argument"]
    return [sys.executable, "-c", PROLOGUE + program, "an argument"]


# Each program in each form; torch's import (seconds in the real process) in one form: the forms differ in how
# the command starts, which the other programs cover.
CASES = [(name, how) for name in PROGRAMS for how in ("script", "module", "code")
         if not name.startswith("torch") or how == "code"]


@pytest.mark.parametrize(("name", "how"), CASES)
def test_a_forked_command_answers_as_a_real_process(name, how, tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "probe_module.py").write_text("VALUE = 42\n")
    command = _command(how, PROGRAMS[name], tmp_path)
    env = {**os.environ, "PREFORKED_PROBE": "seen", "PYTHONPATH": str(tmp_path / "lib")}
    kwargs = dict(cwd=tmp_path, env=env, timeout=120)
    started = preforked.start(command, cwd=tmp_path, env=env)
    started.communicate(timeout=120)
    assert isinstance(started, preforked.ForkedProcess)  # else the comparison below compares a process with itself

    for text in (True, False) if name == "output on both streams" else (True,):
        typed = "typed in ✓\n" if text else "typed in ✓\n".encode()
        forked = preforked.run(command, text=text, input=typed, **kwargs)
        real = subprocess.run(command, capture_output=True, text=text, input=typed, **kwargs)
        if name.startswith("torch"):  # a seed and draws of its own in each process, as each real process has
            assert forked.stdout != preforked.run(command, text=text, input=typed, **kwargs).stdout
            forked.stdout, real.stdout = (_without_draws(o) for o in (forked.stdout, real.stdout))
        assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)


def _without_draws(output):
    first, rest = output.split("\n" if isinstance(output, str) else b"\n", 1)
    threads, _, dtype, *_ = first.split()
    return (threads, dtype, rest)


def test_merged_streams_interleave_as_a_real_processs_do(tmp_path):
    command = [sys.executable, "-c", 'import sys; print("out"); print("err", file=sys.stderr); print("out again")']
    forked = preforked.run(command, text=True, stderr_to_stdout=True)
    real = subprocess.run(command, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert forked.stdout == real.stdout and forked.stderr is None


def test_the_cli_entry_point_answers_as_its_real_process(tmp_path):
    write_small_safetensors(tmp_path / "model.safetensors")
    for arguments in (["--version"], ["inspect", "model.safetensors", "--json"], ["inspect", "missing.safetensors"]):
        command = [materialize_command(), *arguments]
        assert isinstance(preforked.start(command, cwd=tmp_path), preforked.ForkedProcess)
        forked = preforked.run(command, cwd=tmp_path, text=True, timeout=120)
        real = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert real.returncode == 1  # the missing file: a failure compared too


def test_a_command_past_its_timeout_is_killed_and_raises(tmp_path):
    process = preforked.start([sys.executable, "-c", "import time; time.sleep(60)"])
    with pytest.raises(subprocess.TimeoutExpired):
        process.communicate(timeout=1)
    assert process.returncode is not None and process.returncode < 0


def test_a_sitecustomize_on_the_commands_path_runs_first_as_at_a_real_start(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os, sys\nprint('customized', file=sys.stderr)\n"
                                               "os.environ['CUSTOMIZED'] = 'yes'\n")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "sitecustomize.py").write_text("raise RuntimeError('a broken customization')\n")
    command = [sys.executable, "-c", "import os; print(os.environ.get('CUSTOMIZED'))"]
    for folder in (tmp_path, broken):
        env = {**os.environ, "PYTHONPATH": str(folder)}
        assert isinstance(preforked.start(command, env=env), preforked.ForkedProcess)
        forked = preforked.run(command, env=env, text=True, timeout=120)
        real = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
        assert (forked.returncode, forked.stdout, forked.stderr) == (real.returncode, real.stdout, real.stderr)
    assert "Error in sitecustomize" in real.stderr  # the broken one: an interpreter's message, then the command


def test_a_variable_read_only_later_keeps_the_fork(tmp_path):
    # torch sets TORCHINDUCTOR_CACHE_DIR in the test process when something there compiles; it reads it then,
    # never at import, so the server's copy of torch is no different
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    process = preforked.start([sys.executable, "-c", "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])"], env=env)
    out, _ = process.communicate(timeout=120)
    assert isinstance(process, preforked.ForkedProcess) and out.decode().strip() == str(tmp_path)


@pytest.mark.parametrize("why", ["a variable read at import", "installed packages on PYTHONPATH", "an interpreter option",
                                 "PREFORKED=0"])
def test_what_a_fork_could_get_wrong_runs_as_a_real_process(why, tmp_path, monkeypatch):
    command = [sys.executable, "-c", "import os; print(os.environ.get('HF_HOME'))"]
    env = dict(os.environ)
    if why == "a variable read at import":
        env["HF_HOME"] = str(tmp_path)
    elif why == "installed packages on PYTHONPATH":
        (tmp_path / "somepackage-1.0.dist-info").mkdir()
        env["PYTHONPATH"] = str(tmp_path)
    elif why == "an interpreter option":
        command[1:1] = ["-X", "utf8"]
    else:
        monkeypatch.setenv("PREFORKED", "0")
        env = None
    process = preforked.start(command, env=env)
    out, _ = process.communicate(timeout=120)
    assert isinstance(process, preforked.RealProcess)
    assert process.returncode == 0 and out.decode().strip() == str((env or os.environ).get("HF_HOME"))
