"""Write docs/api.md, the API reference, from the docstrings of every name ``materialize.__all__`` exports.

    python -m tools.apiref                  # (make docs-api) rewrite docs/api.md
    python -m tools.apiref --output FILE    # write elsewhere (tests/test_docs.py compares the two)

Each name gets its signature (``inspect.signature``) and docstring; a class its public methods and
properties, and a dataclass every field with its type, described in a ``Fields:`` section of its docstring.
A public name, method or property without a docstring, or a field the docstring does not describe, stops
the script naming each: the page is the docstrings, so it cannot be written around a gap in them.

Docstrings are written in the project's reST-flavoured style (code in double backquotes, roles such as
``:func:``, and Google sections: ``Args:``, ``Raises:``, ``Fields:``, ``Attributes:``); they are turned
into Markdown here.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import sys
import typing
from pathlib import Path
from typing import Any, Callable

import materialize

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "api.md"
SECTIONS = ("Args", "Attributes", "Fields", "Raises", "Returns")
WIDTH = 100  # a signature longer than this gets one parameter a line

HEADER = """\
# API reference

Every public name of `materialize` (`import materialize as mz`), generated from the docstrings by
`tools/apiref.py` (`make docs-api`); edit the docstrings, not this page. The [Library](library.md) page
shows how the calls fit together; the CLI's commands and options are in the README and `materialize --help`.
"""


def _is_error(obj: object) -> bool:
    return inspect.isclass(obj) and issubclass(obj, BaseException)


def _kind(obj: object) -> str:
    return "error" if _is_error(obj) else "class" if inspect.isclass(obj) else "function"


def anchor(name: str, obj: object) -> str:
    """The heading's anchor, as mkdocs (and tests/test_docs.py) make it: classes are ``class-name``, so that
    ``plan`` and ``Plan`` get one each."""
    return name.lower() if _kind(obj) == "function" else f"class-{name.lower()}"


def heading(name: str, obj: object) -> str:
    return name if _kind(obj) == "function" else f"class {name}"


# ------------------------------------------------------------------------------------------ docstrings


def _role(found: re.Match) -> str:
    tilde, target = found.group(1), found.group(2)
    return f"``{target.rsplit('.', 1)[-1] if tilde else target}``"  # reST's ~ shows the last part only


def _inline(text: str) -> str:
    """reST inline markup as Markdown: ``code`` and :role:`~dotted.name` become code spans."""
    text = re.sub(r":[a-z]+:`(~?)([^`]+)`", _role, text)
    return re.sub(r"``(.+?)``(?!`)", r"`\1`", text)


def _blocks(doc: str) -> list[tuple[str, Any]]:
    """A docstring in order: ``("", prose lines)`` and ``(section title, [(name, description), ...])``."""
    blocks: list[tuple[str, Any]] = []
    current: list[tuple[str, str]] | None = None
    for line in doc.splitlines():
        title = line.rstrip()[:-1] if line.rstrip().endswith(":") else None
        if title in SECTIONS and not line.startswith(" "):
            current = []
            blocks.append((title, current))
            continue
        if current is not None and line.startswith("    "):
            item = re.match(r"    (\w+)(?: \([^)]*\))?: ?(.*)", line)
            if item and not line.startswith("     "):
                current.append((item.group(1), item.group(2)))
            elif current:
                name, text = current[-1]
                current[-1] = (name, f"{text} {line.strip()}".strip())
            continue
        if current is not None and not line.strip():
            continue
        current = None
        if not blocks or blocks[-1][0]:
            blocks.append(("", []))
        blocks[-1][1].append(line)
    return blocks


def _rendered(doc: str, types: dict[str, str]) -> tuple[list[str], list[str]]:
    """A docstring as Markdown lines, and the names its ``Fields:`` section describes."""
    lines: list[str] = []
    described: list[str] = []
    for title, content in _blocks(doc):
        if not title:
            lines += [_prose(content), ""]
            continue
        if title == "Fields":
            described = [name for name, _ in content]
        lines += _section(title, content, types)
    return lines, described


def _prose(lines: list[str]) -> str:
    return _inline("\n".join(lines).strip())


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _section(title: str, items: list[tuple[str, str]], types: dict[str, str]) -> list[str]:
    if title == "Fields":
        rows = ["| field | type | description |", "|---|---|---|"]
        rows += [f"| `{name}` | `{_cell(types[name])}` | {_cell(_inline(text))} |" for name, text in items]
        return ["**Fields**", "", *rows, ""]
    return [f"**{title}**", "", *(f"- `{name}`: {_inline(text)}" for name, text in items), ""]


def _own_doc(obj: object) -> str:
    raw = obj.__dict__.get("__doc__") if inspect.isclass(obj) else getattr(obj, "__doc__", None)
    if inspect.isclass(obj) and dataclasses.is_dataclass(obj) and raw and raw.startswith(f"{obj.__name__}("):
        return ""  # the one dataclasses writes from the signature
    return inspect.cleandoc(raw) if raw else ""


# ------------------------------------------------------------------------------------------ signatures


def _annotation(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return re.sub(r"'([\w.]+)'", r"\1", text)  # a forward reference reads as the name it is


def _parameters(signature: inspect.Signature) -> list[str]:
    parts: list[str] = []
    star_done = False
    for parameter in signature.parameters.values():
        if parameter.kind == parameter.KEYWORD_ONLY and not star_done:
            parts.append("*")
        if parameter.kind in (parameter.KEYWORD_ONLY, parameter.VAR_POSITIONAL):
            star_done = True
        prefix = {parameter.VAR_POSITIONAL: "*", parameter.VAR_KEYWORD: "**"}.get(parameter.kind, "")
        text = prefix + parameter.name
        if parameter.annotation is not parameter.empty:
            text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not parameter.empty:
            text += f" = {parameter.default!r}"
        parts.append(text)
    return parts


SHOWN: list[Callable] = []  # every function whose signature the page shows, for the aliases they name


def signature_text(name: str, function: Callable, *, drop_first: bool = False) -> str:
    SHOWN.append(inspect.unwrap(function))
    signature = inspect.signature(function)
    if drop_first:
        signature = signature.replace(parameters=list(signature.parameters.values())[1:])
    parts = _parameters(signature)
    returns = ("" if signature.return_annotation is signature.empty
               else f" -> {_annotation(signature.return_annotation)}")
    flat = f"{name}({', '.join(parts)}){returns}"
    if len(flat) <= WIDTH:
        return flat
    return f"{name}(\n" + "".join(f"    {part},\n" for part in parts) + f"){returns}"


def _code(text: str) -> list[str]:
    return ["```text", text, "```", ""]


# ------------------------------------------------------------------------------------------ the page


def _members(cls: type) -> list[tuple[str, object]]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    kinds = (property, functools.cached_property, classmethod, staticmethod)
    return [(name, value) for name, value in vars(cls).items()
            if not name.startswith("_") and name not in fields and (inspect.isfunction(value) or isinstance(value, kinds))]


def _member_block(cls: type, name: str, value: object, gaps: list[str]) -> list[str]:
    qualified = f"{cls.__name__}.{name}"
    if isinstance(value, (property, functools.cached_property)):
        getter = value.fget if isinstance(value, property) else value.func
        returns = inspect.signature(getter).return_annotation
        shown = f"{name}: {_annotation(returns)}  (property)"
        doc = _own_doc(getter)
    else:
        function = getattr(cls, name)  # bound for a classmethod: cls is not shown
        shown = signature_text(name, function, drop_first=inspect.isfunction(value))
        if isinstance(value, classmethod):
            shown += "  (class method)"
        doc = _own_doc(value.__func__ if isinstance(value, (classmethod, staticmethod)) else value)
    if not doc:
        gaps.append(f"{qualified}: no docstring")
    return [f"#### {qualified}", "", *_code(shown), *_rendered(doc, {})[0]]


def _class_line(cls: type) -> str:
    bases = [base.__name__ for base in cls.__bases__ if base is not object]
    return f"class {cls.__name__}" + (f"({', '.join(bases)})" if bases else "")


def _entry(name: str, obj: Any, gaps: list[str]) -> list[str]:
    doc = _own_doc(obj)
    if not doc:
        gaps.append(f"{name}: no docstring")
    shown = _class_line(obj) if inspect.isclass(obj) else signature_text(name, obj)
    is_dataclass = inspect.isclass(obj) and dataclasses.is_dataclass(obj)
    types = {f.name: _annotation(f.type) for f in dataclasses.fields(obj)} if is_dataclass else {}
    body, described = _rendered(doc, types)
    if is_dataclass and described != list(types):
        gaps.append(f"{name}: the Fields section names {described}, the dataclass's fields are {list(types)}")
    lines = [f"### {heading(name, obj)}", "", *_code(shown), *body]
    if inspect.isclass(obj) and not _is_error(obj):
        for member, value in _members(obj):
            lines += _member_block(obj, member, value, gaps)
    return lines


def _summary(obj: object) -> str:
    """The docstring's first sentence."""
    first = _inline(" ".join(_own_doc(obj).split("\n\n")[0].split()))
    return _cell(re.split(r"(?<=\.) (?=[A-Z`(])", first)[0])


def _definition(name: str) -> str:
    """How the package spells an alias: the right side of its ``NAME = ...`` line."""
    for module in sorted(m for m in sys.modules if m == "materialize" or m.startswith("materialize.")):
        found = re.search(rf"^{name} = (.+?)(?:  #.*)?$", inspect.getsource(sys.modules[module]), flags=re.M)
        if found:
            return found.group(1)
    raise SystemExit(f"tools/apiref.py: no definition of the alias {name} in the package")


def _aliases() -> list[tuple[str, str]]:
    """The type aliases the shown signatures name (``CheckpointLike``), each with what it stands for."""
    found: dict[str, str] = {}
    for function in SHOWN:
        annotations = [a for a in function.__annotations__.values() if isinstance(a, str)]
        for word in re.findall(r"(?<![\w.])[A-Za-z_]\w*(?![\w.])", " ".join(annotations)):
            value = function.__globals__.get(word)
            if word not in found and not hasattr(typing, word) and typing.get_origin(value) is not None:
                found[word] = _definition(word)
    return sorted(found.items())


def render() -> str:
    """The page: an index of every exported name, then functions, classes, errors and warnings."""
    SHOWN.clear()
    names = sorted(materialize.__all__, key=str.lower)
    objects = {name: getattr(materialize, name) for name in names}
    gaps: list[str] = []
    lines = [HEADER, "| name | what it is |", "|---|---|"]
    lines += [f"| [`{name}`](#{anchor(name, obj)}) | {_summary(obj)} |" for name, obj in objects.items()]
    lines.append("")
    for kind, title in (("function", "Functions"), ("class", "Classes"), ("error", "Errors and warnings")):
        lines += [f"## {title}", ""]
        for name, obj in objects.items():
            if _kind(obj) == kind:
                lines += _entry(name, obj, gaps)
    lines += ["## Types", "", "The aliases the signatures above name.", "", "| alias | stands for |", "|---|---|"]
    lines += [f"| `{name}` | `{_cell(definition)}` |" for name, definition in _aliases()]
    if gaps:
        raise SystemExit("tools/apiref.py: the docstrings leave gaps:\n  " + "\n  ".join(gaps))
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", type=Path, default=PAGE, help="where to write the page (default: docs/api.md)")
    args = parser.parse_args(argv)
    args.output.write_text(render())


if __name__ == "__main__":
    main(sys.argv[1:])
