"""Python processes forked from one that has already imported torch: ``subprocess.run``'s answers, seconds sooner.

Most of a CLI or rank process's first seconds go to importing torch (and transformers where a Hugging Face
folder is loaded): some 2 to 6 s before it does anything, paid by a few hundred processes in the suite. Where
the process is not what a test checks (its import cost, its memory, signals sent to it, a terminal), the
test runs its command through :func:`run` or :func:`start` instead: a child forked from a server process
(``multiprocessing``'s forkserver) that imported those libraries once, without running anything with them.

What the child gets is what a fresh ``python`` would: the command's ``argv`` (a script, ``-m module``, ``-c
code``, or a console script such as ``materialize``), ``cwd``, the whole environment, ``sys.path`` as the
interpreter would build it from that script and ``PYTHONPATH``, fresh ``sys.std*`` on the given input and
captured output, ``__main__`` run as a main module, and the interpreter's own ending: non-daemon threads
joined, ``atexit`` handlers run, streams flushed, the exit status (a negative one for a signal) as the
return code. ``tests/test_preforked.py`` compares each of these with a real subprocess.

A ``sitecustomize`` the command's ``PYTHONPATH`` holds runs in the child as ``site`` would run it at start-up
(``tests/vision.py``'s shim is one). Where a fork could differ from a fresh process the command runs as a real
subprocess, unchanged: an environment that differs from the server's in a variable the preloaded libraries read
when imported (torch's, Hugging Face's, ``HOME``, the ``PYTHON*`` flags), a ``PYTHONPATH`` folder of installed
packages (which a preloaded library may look for when imported: transformers imports a torchvision it can see),
interpreter options (``-X``, ``-I``, ...), or ``PREFORKED=0`` in the tests' environment (the whole suite on
real processes, to compare).
"""

from __future__ import annotations

import atexit
import io
import json
import multiprocessing
import os
import re
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import types
from pathlib import Path
from typing import Optional, Sequence, Union

# What the server imports once. Each reads environment variables when imported (caches, devices, threads): a
# command whose environment differs in one of them (IMPORT_TIME_VARIABLES) runs as a real process. Inductor's
# are not among them: torch sets TORCHINDUCTOR_CACHE_DIR in a test's own process the first time it compiles,
# and reads its variables when it compiles, never at import.
PRELOADED = ["torch", "numpy", "safetensors.torch", "click", "transformers", "transformers.modeling_utils"]
IMPORT_TIME_VARIABLES = re.compile(
    r"^(HF_|HUGGINGFACE|TRANSFORMERS|TOKENIZERS|USE_TORCH|USE_TF|USE_JAX|USE_FLAX|TORCH(?!INDUCTOR_)|PYTORCH|CUDA|NVIDIA|OMP_|MKL|"
    r"KMP_|OPENBLAS|GOMP|LD_|XDG_|HOME$|TMPDIR$|PYTHON(?!PATH$|DONTWRITEBYTECODE$))"
)

# The environment the server starts with: the test session's, as it was when the suite began (conftest imports
# this module), so that a test's monkeypatched variable never reaches the preloaded libraries.
_SERVER_ENVIRONMENT = dict(os.environ)
_context: Optional[multiprocessing.context.BaseContext] = None
_interpreter_path: Optional[list[str]] = None

PathLike = Union[str, os.PathLike]


def enabled() -> bool:
    return os.environ.get("PREFORKED", "1") != "0" and sys.platform.startswith("linux")


def run(
    argv: Sequence[object], *, cwd: Optional[PathLike] = None, env: Optional[dict] = None,
    input: Union[str, bytes, None] = None, timeout: Optional[float] = None, text: bool = False,
    capture_output: bool = True, check: bool = False, stderr_to_stdout: bool = False,
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, ...)``, the command forked from the preloaded server where that
    gives what a fresh process would (see the module's docstring)."""
    if not capture_output:
        raise ValueError("preforked.run captures the output; use subprocess.run for a process that shows its own")
    process = start(argv, cwd=cwd, env=env, input=input, text=text, stderr_to_stdout=stderr_to_stdout)
    out, err = process.communicate(timeout=timeout)
    done = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def start(
    argv: Sequence[object], *, cwd: Optional[PathLike] = None, env: Optional[dict] = None,
    input: Union[str, bytes, None] = None, text: bool = False, stderr_to_stdout: bool = False,
) -> "ForkedProcess | RealProcess":
    """A started process (``communicate(timeout)``, ``returncode``, ``kill()``), forked where :func:`run` would."""
    argv = [os.fspath(a) if isinstance(a, os.PathLike) else str(a) for a in argv]
    environment = dict(os.environ if env is None else env)
    directory = os.fspath(cwd) if cwd is not None else os.getcwd()
    command = _parsed(argv)
    why = _why_real(command, argv, environment)
    if why is not None:
        if os.environ.get("PREFORKED_LOG"):  # where the suite runs real processes, and why (docs/testing.md)
            with open(os.environ["PREFORKED_LOG"], "a") as log:
                log.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}: {why}\n")
        return RealProcess(argv, directory, environment, input, text, stderr_to_stdout)
    return ForkedProcess(argv, command, directory, environment, input, text, stderr_to_stdout)


def _why_real(command: Optional[tuple[str, str, list[str]]], argv: list[str], environment: dict) -> Optional[str]:
    """Why the command must run as a real process; None where a fork gives what a real one would."""
    if not enabled():
        return "PREFORKED=0"
    for name in sorted(set(environment) | set(_SERVER_ENVIRONMENT)):
        if IMPORT_TIME_VARIABLES.match(name) and environment.get(name) != _SERVER_ENVIRONMENT.get(name):
            return f"{name} differs from the server's (read when a preloaded library is imported)"
    for folder in filter(None, environment.get("PYTHONPATH", "").split(os.pathsep)):
        # installed packages the preloaded libraries would have found, or tried and failed, at their import
        # (transformers imports a torchvision it can see)
        if any(Path(folder).glob("*.dist-info")) or any(Path(folder).glob("*.egg-info")):
            return f"PYTHONPATH holds installed packages ({folder})"
    if command is None:
        return f"not a Python command a fork can start: {argv[:2]}"
    return None


def _parsed(argv: list[str]) -> Optional[tuple[str, str, list[str]]]:
    """(kind, target, arguments): kind "script" (a path), "module" (a name) or "code" (a text); None for what
    only a real interpreter does (its options, another program)."""
    program = argv[0]
    if _same_file(program, sys.executable):
        if len(argv) >= 3 and argv[1] in ("-m", "-c"):
            return ("module" if argv[1] == "-m" else "code", argv[2], argv[3:])
        if len(argv) >= 2 and not argv[1].startswith("-"):
            return "script", argv[1], argv[2:]
        return None
    found = program if os.sep in program else shutil.which(program)
    if found and _is_python_script(found):  # the kernel hands the interpreter the script's path
        return "script", found, argv[1:]
    return None


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _is_python_script(path: str) -> bool:
    """A console script of this interpreter (its shebang names it)."""
    try:
        with open(path, "rb") as file:
            first = file.readline(512)
    except OSError:
        return False
    return first.startswith(b"#!") and _same_file(first[2:].strip().decode(errors="replace"), sys.executable)


class RealProcess:
    """A real subprocess behind the same face as :class:`ForkedProcess`."""

    def __init__(self, argv, cwd, env, input, text, stderr_to_stdout):
        self.args = argv
        self._input = input
        self._popen = subprocess.Popen(
            argv, cwd=cwd, env=env, text=text, stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT if stderr_to_stdout else subprocess.PIPE,
        )

    @property
    def returncode(self) -> Optional[int]:
        return self._popen.returncode

    @property
    def pid(self) -> int:
        return self._popen.pid

    def communicate(self, timeout: Optional[float] = None):
        try:
            return self._popen.communicate(self._input, timeout=timeout)
        except subprocess.TimeoutExpired:
            self._popen.kill()
            self._popen.communicate()
            raise

    def kill(self) -> None:
        self._popen.kill()


class ForkedProcess:
    """A command running in a child of the preloaded server; its output in files until :meth:`communicate`."""

    def __init__(self, argv, command, cwd, env, input, text, stderr_to_stdout):
        self.args = argv
        self._text = text
        self._folder = Path(tempfile.mkdtemp(prefix="preforked-"))
        stdin = None
        if input is not None:
            stdin = self._folder / "stdin"
            stdin.write_bytes(input.encode() if isinstance(input, str) else input)
        self._stdout = self._folder / "stdout"
        self._stderr = self._stdout if stderr_to_stdout else self._folder / "stderr"
        request = {
            "kind": command[0], "target": command[1], "arguments": command[2], "cwd": cwd, "env": env,
            "path": _python_path(command, cwd, env), "stdin": str(stdin) if stdin else None,
            "stdout": str(self._stdout), "stderr": str(self._stderr),
        }
        self._process = _server().Process(target=_child, args=(json.dumps(request),), daemon=False)
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")  # else the child would import this process's main
        try:
            self._process.start()
        finally:
            sys.modules["__main__"] = main

    @property
    def pid(self) -> Optional[int]:
        return self._process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def communicate(self, timeout: Optional[float] = None):
        self._process.join(timeout)
        if self._process.exitcode is None:
            self.kill()
            self._process.join()
            self._collect()
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._collect()

    def kill(self) -> None:
        if self._process.exitcode is None:
            self._process.kill()

    def _collect(self):
        def read(path: Path):
            data = path.read_bytes() if path.exists() else b""
            # subprocess's text mode: the locale's encoding, universal newlines
            return data.decode().replace("\r\n", "\n").replace("\r", "\n") if self._text else data

        out = read(self._stdout)
        err = None if self._stderr == self._stdout else read(self._stderr)
        shutil.rmtree(self._folder, ignore_errors=True)
        return out, err


def _server() -> multiprocessing.context.BaseContext:
    """The forkserver context, started with the session's first environment and the preloaded libraries."""
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOADED)
        saved = dict(os.environ)
        try:  # the server inherits os.environ as it is now: the suite's own, not a test's
            os.environ.clear()
            os.environ.update(_SERVER_ENVIRONMENT)
            from multiprocessing import forkserver

            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(saved)
        _context = context
    return _context


def _python_path(command: tuple[str, str, list[str]], cwd: str, env: dict) -> list[str]:
    """``sys.path`` as a fresh interpreter builds it: the script's folder (the cwd for -m, '' for -c), then
    PYTHONPATH, then the interpreter's own (standard library, site-packages and their .pth entries)."""
    global _interpreter_path
    if _interpreter_path is None:
        plain = {k: v for k, v in _SERVER_ENVIRONMENT.items() if k != "PYTHONPATH"}
        shown = subprocess.run([sys.executable, "-c", "import json, sys; print(json.dumps(sys.path[1:]))"],
                               capture_output=True, text=True, env=plain, check=True, cwd="/")
        _interpreter_path = json.loads(shown.stdout)
    kind, target, _ = command
    first = {"script": os.path.dirname(os.path.realpath(os.path.join(cwd, target))), "module": cwd, "code": ""}[kind]
    extra = [os.path.join(cwd, p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [first, *extra, *_interpreter_path]


def _child(request_text: str) -> None:
    """In the forked child: become the requested interpreter, run the command, end as Python ends."""
    request = json.loads(request_text)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    sys.path[:] = request["path"]
    sys.path_importer_cache.clear()
    for name in ("SIGINT", "SIGTERM", "SIGCHLD"):  # a fresh interpreter's handlers, not the server's
        signal.signal(getattr(signal, name), signal.default_int_handler if name == "SIGINT" else signal.SIG_DFL)
    _redirect(0, request["stdin"] or os.devnull, os.O_RDONLY)
    _redirect(1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    if request["stderr"] == request["stdout"]:
        os.dup2(1, 2)
    else:
        _redirect(2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)),
                                                 encoding="utf-8", errors="strict")
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))  # python -u: no buffer under the text layer
    sys.stdout = sys.__stdout__ = _output_stream(1, "strict", unbuffered, line_buffering=False)
    sys.stderr = sys.__stderr__ = _output_stream(2, "backslashreplace", unbuffered, line_buffering=True)
    _reseed()
    _run_site_customizations()
    code = _exit_code(request)
    try:
        threading._shutdown()  # what the interpreter does before atexit: join non-daemon threads
    except Exception:  # noqa: BLE001 - never the command's fault
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream, as at an interpreter's exit
            pass
    os._exit(code)


def _output_stream(fd: int, errors: str, unbuffered: bool, line_buffering: bool) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=line_buffering, write_through=unbuffered)


def _reseed() -> None:
    """Fresh processes draw different random numbers: each child seeds the preloaded generators anew, as their
    import would have (Python's own ``random`` reseeds itself after a fork)."""
    if "torch" in sys.modules:
        sys.modules["torch"].seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def _run_site_customizations() -> None:
    """What ``site`` does at an interpreter's start with the command's ``sys.path``: import the first
    ``sitecustomize`` (and ``usercustomize`` where user sites are on), printing an error and going on as it does.
    The server's own, if it imported one, goes first: the command's path decides which runs."""
    import site

    for name in ("sitecustomize", "usercustomize"):
        sys.modules.pop(name, None)
    site.execsitecustomize()
    if site.ENABLE_USER_SITE:
        site.execusercustomize()


def _redirect(fd: int, path: str, flags: int) -> None:
    opened = os.open(path, flags, 0o644)
    os.dup2(opened, fd)
    os.close(opened)


def _exit_code(request: dict) -> int:
    """Run the command as ``python`` would; its exit status, with the traceback an interpreter prints."""
    kind, target, arguments = request["kind"], request["target"], request["arguments"]
    try:
        if kind == "module":
            sys.argv = [target, *arguments]  # runpy puts the module's file in argv[0], as python -m does
            runpy._run_module_as_main(target, alter_argv=True)
        elif kind == "code":
            sys.argv = ["-c", *arguments]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(target, "<string>", "exec"), main.__dict__)
        else:
            sys.argv = [target, *arguments]
            runpy.run_path(target, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            return 0
        if isinstance(stop.code, int):
            return stop.code & 0xFF
        print(stop.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as interrupt:
        trace = _from_the_command(interrupt.__traceback__, kind)
        sys.excepthook(KeyboardInterrupt, interrupt.with_traceback(trace), trace)
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException as error:  # noqa: BLE001 - what the interpreter does with any other: print it, exit 1
        trace = _from_the_command(error.__traceback__, kind)  # the printer reads the exception's own
        sys.excepthook(type(error), error.with_traceback(trace), trace)
        return 1
    return 0


def _from_the_command(trace, kind: str):
    """The traceback from the command's first frame, as an interpreter prints it (python -m keeps runpy's)."""
    ours = {__file__} if kind == "module" else {__file__, runpy.__file__, "<frozen runpy>"}
    while trace is not None and trace.tb_next is not None and trace.tb_frame.f_code.co_filename in ours:
        trace = trace.tb_next
    return trace
