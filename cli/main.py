"""``materialize``: parse, call the library, print. No logic a script could not reach."""

from __future__ import annotations

import operator
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional

import click

import materialize as mz
from materialize.errors import summarize_names
from materialize.integrations.hub import looks_like_repo_id, resolve as resolve_source
from materialize.sources import is_url
from materialize.progress import Progress, above_the_bar
from materialize.sizes import format_bytes
from materialize.text import printable

from ._errors import one_line
from ._output import (JSON_HELP, VERBOSE_HELP, echo_lines, echo_stderr_line, json_text, never_fail_to_encode,
                      show_logs)
from .params import DEVICE, DEVICE_MAP, DTYPE, HEADER, MAX_MEMORY, MODEL_ARG, REGEX, RENAME, SIZE

if TYPE_CHECKING:
    import torch

DEFAULT_COMMAND = "load"
GROUP_FLAGS = {"--help", "-h", "--version"}
VERBOSE_FLAG = re.compile(r"-v+|--verbose")  # the group's own option, before the command: materialize -v CHECKPOINT


class HelpFormatter(click.HelpFormatter):
    """Help as text only: any character a terminal would act on (a control, a bidi override) in a docstring or
    an option's help is shown as its escape (see materialize.text.printable), as names from files are."""

    def getvalue(self) -> str:
        return "\n".join(map(printable, super().getvalue().split("\n")))


class Context(click.Context):
    formatter_class = HelpFormatter


class Command(click.Command):
    context_class = Context


class DefaultCommandGroup(click.Group):
    """``materialize CHECKPOINT ...`` runs ``load``; named subcommands run as usual."""

    context_class = Context
    command_class = Command

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        at = next((i for i, arg in enumerate(args) if not VERBOSE_FLAG.fullmatch(arg)), len(args))
        if at < len(args) and args[at] not in self.commands and args[at] not in GROUP_FLAGS:
            args = [*args[:at], DEFAULT_COMMAND, *args[at:]]
        return super().parse_args(ctx, args)


def _verbosity(ctx: click.Context, param: click.Parameter, count: int) -> None:
    """``-v`` counted where it is given, before the command (the group's) and after it (the command's): the
    library's log records shown on stderr from the first (see :func:`~materialize_cli._output.show_logs`),
    until the command ends."""
    if ctx.resilient_parsing:  # shell completion parses the line: nothing runs, nothing is to be shown
        return
    total = ctx.meta.get("materialize.verbose", 0) + count  # the group's count, then the command's added
    ctx.meta["materialize.verbose"] = total
    show_logs(total)
    if total:
        ctx.call_on_close(lambda: show_logs(0))


verbose_option = click.option("-v", "--verbose", count=True, expose_value=False, callback=_verbosity,
                              help=VERBOSE_HELP)


def _run(debug: bool, action: Callable[[], None], *, inspecting: bool = False) -> None:
    """Run a command body; expected errors become one line and exit code 1, the library's warnings one line each."""
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            action()
    except click.ClickException:
        raise  # usage errors keep click's own message and exit code 2
    except (mz.ModelRequiredError, mz.ModelSpecUsageError) as error:  # what was typed cannot be used: exit 2
        raise click.UsageError(one_line(error)) from None
    except (mz.MaterializeError, OSError, MemoryError) as error:
        if debug:
            raise
        click.echo(f"Error: {one_line(error, inspecting=inspecting)}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("Error: interrupted", err=True)
        sys.exit(130)
    except Exception as error:  # a bug of ours: still one line, the traceback on request
        if debug:
            raise
        click.echo(f"Error: {one_line(error)}", err=True)
        sys.exit(1)


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: Optional[str] = None) -> None:
    with above_the_bar():  # a line of its own, not the end of the progress bar's
        if issubclass(category, mz.MaterializeWarning):
            echo_stderr_line("Warning", str(message))  # on stderr: --json keeps stdout to itself
        else:  # Python's own form, escaped too: another library's warning can quote a name from the file
            shown = warnings.formatwarning(message, category, filename, lineno, line)
            click.echo("\n".join(map(printable, shown.rstrip("\n").split("\n"))), err=True)


@contextmanager
def _progress(as_json: bool) -> Iterator[Optional[Progress]]:
    """The library's progress bar on stderr, where a person watches the command: both stdout and stderr are
    terminals, and no --json. Output sent to a file or a pipe (``materialize ... > report.txt``, a job's log)
    is a script's, which has no one to show a bar to. Closed before an error is printed, its line cleared
    (the report that follows says what it said), so every ``Error:`` line starts on a clean line.
    """
    if as_json or not (sys.stdout.isatty() and sys.stderr.isatty()):
        yield None
        return
    with Progress(sys.stderr, leave=False) as bar:
        if "torch" not in sys.modules:
            bar.phase("importing torch")  # the command's first seconds, before the library can tell its steps
        yield bar


def _emit(as_json: bool, payload: Callable[[], dict], lines: Callable[[], Iterable[str]],
          about: Optional[str] = None, *, escaped: bool = False) -> None:
    """The command's output: only the form asked for is built (a text form can be far larger than the JSON);
    ``about``, the file a value too deep to write as JSON is refused for; ``escaped``, the lines are made of
    escaped parts (see :func:`~materialize_cli._output.echo_lines`)."""
    if as_json:
        click.echo(json_text(payload(), about=about))
    else:
        echo_lines(lines(), escaped=escaped)


# readable=False: the library opens the file and reports the real error, with exit 1
checkpoint_argument = click.argument("checkpoint", type=click.Path(dir_okay=True, readable=False, path_type=str))
state_dict_key_option = click.option(
    "--state-dict-key", metavar="KEY", default=None,
    help="The entry of a training checkpoint that holds the model (state_dict, state_dict_ema, ...), where it holds several.")
model_options = [
    click.option("--model", "model_spec", metavar="SPEC",
                 help="package.module:callable, path/to/model.py:callable, a configs/ TOML file, hf:ClassName (default: config.json's architecture), timm:NAME or torchvision:NAME."),
    click.option("--model-arg", "model_args", type=MODEL_ARG, multiple=True, help="KEY=VALUE passed to the model factory (JSON literal values)."),
    click.option("--device", type=DEVICE, default="cpu", show_default=True, help="Where the tensors are allocated."),
    click.option("--device-map", type=DEVICE_MAP, default=None,
                 help="Spread over devices: auto|balanced|balanced_low_0|sequential, or JSON {module: device|\"disk\"}."),
    click.option("--max-memory", type=MAX_MEMORY, default=None, help="Budget per device for --device-map, e.g. 0=70GiB,cpu=100GiB."),
    click.option("--dtype", type=DTYPE, default=None, help="Cast floating tensors; default auto keeps the checkpoint's dtypes."),
    click.option("--strict/--no-strict", default=True, show_default=True, help="Missing or unexpected tensors are an error; --no-strict initializes missing ones."),
    click.option("--ignore-mismatched-sizes", is_flag=True,
                 help="Initialize, instead of loading, tensors whose checkpoint shape differs (a new head)."),
    click.option("--ignore-unexpected", is_flag=True,
                 help="Leave the checkpoint's tensors the model lacks unread (a pipeline stage), still requiring all of the model's."),
    click.option("--ignore-unexpected-matching", "ignore_unexpected_patterns", type=REGEX, multiple=True, metavar="REGEX",
                 help="Leave unread the unexpected checkpoint tensors whose names this finds (repeatable)."),
    click.option("--strip-prefix", metavar="PREFIX", help="Remove PREFIX from checkpoint names (e.g. 'model.')."),
    click.option("--add-prefix", metavar="PREFIX", help="Prepend PREFIX to checkpoint names."),
    click.option("--rename", "renames", type=RENAME, multiple=True, help="Regex rename of checkpoint names, applied in order after --strip-prefix."),
    click.option("--revision", metavar="REV", help="Hub revision (branch, tag or commit) when CHECKPOINT is a repo id."),
    click.option("--trust-pickle", is_flag=True, help="Allow a pickled model (torch.save(model)): imports its classes and may run its code."),
    state_dict_key_option,
    click.option("--json", "as_json", is_flag=True, help=JSON_HELP),
    click.option("--debug", is_flag=True, help="Show the traceback of an error."),
]
remote_options = [  # how a URL (s3://, gs://, az://, https://) or a streamed hub repo is read: docs/remote.md
    click.option("--stream", is_flag=True,
                 help="CHECKPOINT is a hub repo id: read its weights from the hub by ranged GETs, downloading none "
                      "(config and index are fetched)."),
    click.option("--connections", type=click.IntRange(min=1), default=None, metavar="N",
                 help="Requests in flight at once for a URL or --stream (default 16)."),
    click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=None, metavar="SECONDS",
                 help="Seconds without an answer's next bytes, or for its headers all told, before a request is retried (default 60)."),
    click.option("--min-rate", type=click.FloatRange(min=0, min_open=True), default=None, metavar="BYTES",
                 help="Bytes a second an answer must average once it has run --request-timeout seconds, else it is retried (default 16384)."),
    click.option("--retries", type=click.IntRange(min=0), default=None, metavar="N",
                 help="Retries of a failed request, each resuming where it stopped (default 8)."),
    click.option("--no-sign-request", "anonymous", is_flag=True,
                 help="Read s3://, gs:// and az:// without credentials (a public bucket or container)."),
    click.option("--header", "headers", type=HEADER, multiple=True, metavar="'NAME: VALUE'",
                 help="Send this header to an http(s):// source's server (repeatable), e.g. 'Authorization: Bearer T'."),
]
memory_options = [  # a plan's memory estimate depends on them too
    click.option("--mmap", is_flag=True, help="CPU only: tensors become copy-on-write views of the files (zero-copy)."),
    click.option("--staging-size", "staging_bytes", type=SIZE, default=None, help="Pinned host memory for GPU loads (default 64MiB)."),
]
load_only_options = [
    click.option("--check", is_flag=True, help="Sanitizer: poison fresh memory and prove every tensor was written exactly once."),
    click.option("--check-finite", is_flag=True, help="Fail (exit 1) if a tensor holds NaN or Inf, naming them."),
    click.option("--allow-overflow", is_flag=True, help="Let a cast to a narrower float type turn large values into inf."),
    click.option("--direct-io", is_flag=True, help="Read around the page cache (O_DIRECT): for cold checkpoints on fast storage."),
]


def key_map_from(strip_prefix: Optional[str], add_prefix: Optional[str], renames: tuple) -> Optional[mz.KeyMap]:
    parts = []
    if strip_prefix:
        parts.append(mz.KeyMap.strip_prefix(strip_prefix))
    parts += [mz.KeyMap.regex({pattern: replacement}) for pattern, replacement in renames]  # a pattern twice: two rules
    if add_prefix:
        parts.append(mz.KeyMap.add_prefix(add_prefix))
    return sum(parts[1:], parts[0]) if parts else None


def remote_from(options: dict[str, Any]) -> Optional[mz.RemoteOptions]:
    """The remote options given (removed from ``options``), or ``None`` where none was."""
    given = {name: options.pop(option) for option, name in (("connections", "connections"),
             ("request_timeout", "timeout"), ("min_rate", "min_rate"), ("retries", "retries"), ("anonymous", "anonymous"))}
    given = {name: value for name, value in given.items() if value is not None and value is not False}  # 0 is given
    if options.get("headers"):
        given["headers"] = dict(options["headers"])
    options.pop("headers", None)
    return mz.RemoteOptions(**given) if given else None


def refuse_unusable_source(checkpoint: str, options: dict[str, Any]) -> None:
    """What cannot apply to this CHECKPOINT is a usage error (exit 2), before anything is read."""
    remote = is_url(checkpoint)
    if options.get("stream") and (remote or not looks_like_repo_id(checkpoint)):
        raise click.UsageError(f"--stream reads a hub repo id (org/name); {checkpoint!r} is "
                               f"{'a URL, which is always streamed' if remote else 'a local path'}: leave --stream out")
    if remote and options.get("mmap"):
        raise click.UsageError("--mmap maps local files; a URL is read into memory: leave --mmap out")
    if remote and options.get("revision"):
        raise click.UsageError("--revision picks a hub revision; a URL names its object already")


def library_keywords(options: dict[str, Any]) -> dict[str, Any]:
    """The library's keyword arguments for the options ``load`` and ``plan`` share (and those only ``load``
    has): the same names, but for the model spec and its arguments, the renames, which make one key map, and
    the two ways to ignore unexpected tensors, which make one ``ignore_unexpected``."""
    keywords = dict(options)
    keywords["remote"] = remote_from(keywords)
    keywords["key_map"] = key_map_from(keywords.pop("strip_prefix"), keywords.pop("add_prefix"), keywords.pop("renames"))
    keywords["model"] = keywords.pop("model_spec")
    keywords["model_args"] = dict(keywords.pop("model_args"))
    patterns = list(keywords.pop("ignore_unexpected_patterns"))
    keywords["ignore_unexpected"] = True if keywords["ignore_unexpected"] else (patterns or False)
    return keywords


def with_options(options: list) -> Callable:
    def decorate(function: Callable) -> Callable:
        for option in reversed(options):
            function = option(function)
        return function

    return decorate


@click.group(cls=DefaultCommandGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(mz.__version__, prog_name="materialize")
@verbose_option
def main() -> None:
    """Materialize a PyTorch checkpoint: every tensor allocated once, straight from the file.

    \b
      materialize CHECKPOINT [--model SPEC] [--device cuda] [--dtype bf16]
      materialize s3://bucket/llama/ --device cuda      (or https://..., or org/name --stream)
      materialize inspect CHECKPOINT
      materialize plan CHECKPOINT [--model SPEC]
      materialize convert SRC DST [--dtype bf16] [--shard-size 5GB]

    Names from files are shown with control and other non-printable characters as backslash escapes
    (\\x1b, \\n, \\u202e); --json gives them exactly.
    """
    never_fail_to_encode()


@main.command(DEFAULT_COMMAND)
@checkpoint_argument
@with_options(model_options + remote_options + memory_options + load_only_options)
@verbose_option
def load_command(checkpoint: str, as_json: bool, debug: bool, **options: Any) -> None:
    """(default) Build the model on meta and materialize CHECKPOINT into it.

    CHECKPOINT is a file, a shard index, a folder (Hugging Face layout), a hub repo id (org/name), or a URL
    (s3://bucket/prefix/, https://host/model.safetensors) read straight into memory with no local copy.
    """
    refuse_unusable_source(checkpoint, options)

    def action() -> None:
        with _progress(as_json) as progress:
            _, report = mz.load_model(checkpoint, progress=progress, **library_keywords(options))
        checked = options["check"]  # a failed check raised; getting here is the verdict

        def payload() -> dict:
            return {**report.to_dict(), **({"check": "passed"} if checked else {})}

        def lines() -> list[str]:
            return str(report).split("\n") + (
                ["check                 passed: every tensor written exactly once, as planned, no poison left"]
                if checked else [])

        _emit(as_json, payload, lines, report.checkpoint)
        if options["check_finite"] and report.nonfinite:  # a check that finds what it looks for fails the command
            raise mz.MaterializeError(f"NaN or Inf in {len(report.nonfinite)} tensor(s): "
                                      f"{summarize_names(report.nonfinite)}", path=report.checkpoint)

    _run(debug, action)


@main.command("inspect")
@checkpoint_argument
@click.option("--trust-pickle", is_flag=True, help="Allow a pickled model (torch.save(model)).")
@state_dict_key_option
@click.option("--revision", metavar="REV", help="Hub revision (branch, tag or commit) when CHECKPOINT is a repo id.")
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--debug", is_flag=True, help="Show the traceback of an error.")
@with_options(remote_options)
@verbose_option
def inspect_command(checkpoint: str, trust_pickle: bool, state_dict_key: Optional[str], revision: Optional[str],
                    as_json: bool, debug: bool, **options: Any) -> None:
    """List tensors, dtypes, shapes and shards; reads no tensor data.

    CHECKPOINT is a file, a shard index, a folder, a hub repo id (org/name) or a URL, as for a load.
    """
    refuse_unusable_source(checkpoint, {**options, "revision": revision})
    stream, remote = options.pop("stream"), remote_from(options)

    def action() -> None:
        # a hub id as a load finds it; a path as it is; a URL as its remote object
        source = resolve_source(checkpoint, revision=revision, stream=stream, remote=remote)
        with mz.open_checkpoint(source, trust_pickle=trust_pickle, state_dict_key=state_dict_key) as ckpt:
            _emit(as_json, lambda: mz.inspect(ckpt), lambda: _inspect_lines(ckpt), str(ckpt.path), escaped=True)

    _run(debug, action, inspecting=True)


# The name column is as wide as the longest name up to this many characters; a longer name is shown in full
# on its own row, the other columns after it, so that one long name does not pad every row (a 4 MB name beside
# 4,000 tensors would print 16 GB).
NAME_COLUMN = 64


def _inspect_lines(ckpt: mz.Checkpoint) -> Iterator[str]:
    """``inspect``'s lines, one a tensor after the first, every text from the file escaped (see
    materialize.text.printable), so that they are printed as they are: what it prints is bounded by the names'
    own length (4 characters per byte of the file at most) plus a row's columns."""
    yield printable(f"{ckpt.path}  ({ckpt.format}, {len(ckpt)} tensors, {format_bytes(ckpt.nbytes)}, "
                    f"{len(ckpt.shards)} file(s))")
    if ckpt.state_dict_key is not None:
        yield printable(f"state dict: entry {ckpt.state_dict_key!r} of the saved dict")
    if ckpt.module is not None:
        yield printable(f"pickled module: {type(ckpt.module).__module__}.{type(ckpt.module).__qualname__}")
    infos = list(ckpt.values())
    names = list(map(operator.attrgetter("name"), infos))
    if not "".join(names).isprintable():  # (names all printable, the common case, are asked once, not one by one)
        names = list(map(printable, names))  # each escaped once, for the width and for its row
    width = max((len(shown) for shown in names if len(shown) <= NAME_COLUMN), default=4)
    many_files = len(ckpt.shards) > 1
    # The columns after the name, made once for each kind of tensor: a checkpoint of a hundred thousand experts
    # has a few (inspect is to answer within a second).
    columns: dict[tuple, str] = {}
    for shown, info in zip(names, infos):
        # (its dtype and shape make its size); a file by its object's id (a shard's tensors share it, and infos
        # holds them): a Path hashes in Python
        kind = (info.dtype_name, info.shape, id(info.path) if many_files else None)
        rest = columns.get(kind)
        if rest is None:
            shape = "x".join(map(str, info.shape)) or "scalar"
            rest = columns[kind] = (f"  {info.dtype_name:<14} {shape:<20} {format_bytes(info.nbytes):>10}"
                                    + (f"  {printable(info.path.name)}" if many_files else ""))
        yield shown.ljust(width) + rest


@main.command("plan")
@checkpoint_argument
@with_options(model_options + remote_options + memory_options)
@verbose_option
def plan_command(checkpoint: str, as_json: bool, debug: bool, **options: Any) -> None:
    """What a load would do: per-device bytes, memory, ties, missing and unexpected; reads no tensor data (but
    the few values a model's own load code asks for, 1 MiB at most). Without --model, and no model in
    CHECKPOINT, the plain load of its tensors. Exits 1, after the plan, with the load's own error where that
    load would be refused for memory (and warns as it would warn)."""
    refuse_unusable_source(checkpoint, options)

    def action() -> None:
        keywords = library_keywords(options)
        the_plan = mz.plan(keywords.pop("model"), checkpoint, **keywords)
        _emit(as_json, the_plan.to_dict, lambda: _plan_text(the_plan.to_dict()).split("\n"), str(the_plan.path))
        mz.check_memory(the_plan)

    _run(debug, action)


@main.command("convert")
@click.argument("src", type=click.Path(dir_okay=True, readable=False, path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--dtype", type=DTYPE, default=None, help="Cast floating tensors (default: keep each one's dtype).")
@click.option("--shard-size", default="5GB", show_default=True, type=SIZE,
              help="Most bytes per shard when DST is a folder.")
@click.option("--overwrite", is_flag=True,
              help="DST exists: replace the file, or in a folder only what a conversion writes (model*.safetensors "
                   "shards, their index, SRC's config and tokenizer files), keeping its other files.")
@click.option("--allow-overflow", is_flag=True, help="Let a cast to a narrower float type turn large values into inf.")
@click.option("--allow-expansion", is_flag=True,
              help="Write in full tensors that repeat a few stored bytes (expand views) past 16x (16 MiB in all).")
@click.option("--revision", default=None, help="Hub revision when SRC is a repo id.")
@click.option("--trust-pickle", is_flag=True, help="Allow a pickled model (torch.save(model)); runs its code.")
@state_dict_key_option
@click.option("--json", "as_json", is_flag=True, help=JSON_HELP)
@click.option("--debug", is_flag=True, help="Show the traceback of an error.")
@verbose_option
def convert_command(src: str, dst: str, dtype: "Optional[torch.dtype]", shard_size: int, overwrite: bool,
                    allow_overflow: bool, allow_expansion: bool, revision: Optional[str], trust_pickle: bool,
                    state_dict_key: Optional[str], as_json: bool, debug: bool) -> None:
    """Rewrite SRC (any checkpoint) as safetensors at DST.

    DST ending in .safetensors is one file; otherwise a folder in the Hugging Face layout (shards and an index
    when larger than --shard-size, plus SRC's config and tokenizer files). DST is left as it was if it fails.
    --overwrite into a folder also removes an earlier conversion's shards and index it does not write again (another
    shard count); a file is never turned into a folder, nor a folder into a file.
    """

    def action() -> None:
        with _progress(as_json) as progress:
            report = mz.convert(
                src, dst, dtype=dtype, shard_size=shard_size, overwrite=overwrite, trust_pickle=trust_pickle,
                state_dict_key=state_dict_key, allow_overflow=allow_overflow, allow_expansion=allow_expansion, revision=revision, progress=progress,
            )
        _emit(as_json, report.to_dict, lambda: str(report).split("\n"), report.source)

    _run(debug, action)


def _plan_text(summary: dict[str, Any]) -> str:
    """The plan in words; each name from the checkpoint or the model escaped (see materialize.text.printable)."""
    counts = summary["tensors"]
    entry = summary["state_dict_key"]
    if summary["into"] == "dict":
        tensors = f"{counts['load']} to load, as a plain dict (no model)"
    else:
        tensors = f"{counts['load']} to load, {counts['init']} to initialize, {counts['keep']} buffers kept"
    mapped = summary["mapped_bytes"]
    lines = [
        f"checkpoint   {summary['checkpoint']}" + (f" (entry {entry!r})" if entry is not None else ""),
        f"tensors      {tensors}",
        f"read         {format_bytes(summary['read_bytes'])}"
        + (f", and {format_bytes(mapped)} mapped from the files (read as used)" if mapped else ""),
    ]
    lines += [f"on {device:<9} {format_bytes(n)}" for device, n in summary["bytes_by_device"].items()]
    lines += [_memory_line(device, memory) for device, memory in summary["memory"].items()]
    lines += [f"tied         {', '.join(map(printable, group))}" for group in summary["tied_groups"]]
    lines += [f"tie to check {' / '.join(printable(names[0]) for names in check)} (the checkpoint holds each: tied if equal)"
              for check in summary["ties_to_compare"]]
    for key in ("missing", "unexpected", "ignored"):
        if summary[key]:
            lines.append(f"{key:<12} {', '.join(map(printable, summary[key]))}")
    if summary["fed_to_load_code"]:
        fed = ", ".join(map(printable, summary["fed_to_load_code"]))
        lines.append(f"load code    reads {fed} (the model's own, run once loaded)")
    if summary["filled_by_load_code"]:
        filled = ", ".join(map(printable, summary["filled_by_load_code"]))
        lines.append(f"made by code {filled} (the model's own load code)")
    renames = [f"{printable(old)} -> {printable(new)}" for old, new in summary["renamed_by_model"].items()]
    if renames:
        lines.append(f"renamed      {summarize_names(renames)} (by the model's own load code)")
    return "\n".join(lines)


def _memory_line(device: str, memory: dict[str, Any]) -> str:
    """One device's memory verdict; the host's tells a load that is refused from one that warns and goes on."""
    needed, available, limit = memory["needed"], memory["available"], memory.get("limit")
    if limit is not None and needed > limit:
        verdict = f"DOES NOT FIT: more than the {format_bytes(limit)} this process can ever have; the load is refused"
    elif memory["fits"] is False and device == "cpu":
        verdict = "DOES NOT FIT now: the load would warn and go on, and may swap"
    else:
        verdict = {True: "fits", False: "DOES NOT FIT", None: "available memory unknown"}[memory["fits"]]
    peak = "peak host memory" if device == "cpu" else f"memory on {device}"
    shown = f" of {format_bytes(available)} available" if available is not None else ""
    return f"{peak}: {format_bytes(needed)}{shown}: {verdict}"


if __name__ == "__main__":  # pragma: no cover
    main()
