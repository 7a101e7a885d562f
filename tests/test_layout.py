"""The package keeps the shape docs/index.md describes: no import cycle, no private name imported across
modules, and every module in a folder of the pipeline."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "materialize"
FOLDERS = {"sources", "checkpoint", "skeleton", "planning", "io", "integrations"}
TOP_LEVEL = {"__init__", "api", "options", "loading", "conversion", "sanitizer", "errors", "report", "dtypes", "sizes",
             "text", "progress", "inspection", "gcpause"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """(absolute module, names) of every import of the package's own code in ``path``, wherever it is made."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            found.append((".".join(base + ([node.module] if node.module else [])), [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("materialize"):
            found.append((node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("materialize")]
    return found


def test_no_module_imports_itself_back_through_others():
    graph = {}
    for name, path in MODULES.items():
        targets = set()
        for module, names in imports(path):
            targets |= {t for t in [module, *(f"{module}.{n}" for n in names)] if t in MODULES and t != name}
        graph[name] = targets
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)

    assert cycles == []


def test_no_private_name_is_imported_from_another_module():
    private = [f"{module_name(path)} imports {module}.{n}" for path in MODULES.values()
               for module, names in imports(path) for n in names if n.startswith("_") and n != "__version__"]

    assert private == []


def test_every_module_sits_in_a_folder_of_the_pipeline():
    stray = [name for name in MODULES if name.count(".") == 1 and name.split(".")[1] not in TOP_LEVEL | FOLDERS]

    assert stray == []
    assert {name.split(".")[1] for name in MODULES if name.count(".") >= 2} <= FOLDERS


def imported_modules(name: str) -> set[str]:
    """The package's modules ``name`` imports (``from pkg import module`` counted as the module)."""
    found = set()
    for module, names in imports(MODULES[name]):
        found |= {t for t in [module, *(f"{module}.{n}" for n in names)] if t in MODULES}
    return found


def test_sources_sit_at_the_bottom_and_import_nothing_above_them():
    # Where bytes come from is below every reader: a store knows URLs and bytes, never formats or plans.
    allowed = ("materialize.sources", "materialize.errors", "materialize.text")
    upward = sorted(f"{name} imports {target}" for name in MODULES if name.startswith("materialize.sources")
                    for target in imported_modules(name) if not target.startswith(allowed))
    assert upward == []


def test_planning_decides_and_never_reaches_into_the_io_layer():
    # The plan is what a load will do; io/ carries it out (and may read the plan), never the other way.
    upward = sorted(f"{name} imports {target}" for name in MODULES if name.startswith("materialize.planning")
                    for target in imported_modules(name) if target.startswith("materialize.io"))

    assert upward == []


def test_every_read_goes_through_the_one_executor():
    # load, load_tensors and convert hand their jobs to io.executor.Reads; only it drives the engine.
    callers = sorted(name for name in MODULES for module, names in imports(MODULES[name])
                     if module == "materialize.io.engine" and "stream" in names)
    users = {name for name in MODULES if "materialize.io.executor" in imported_modules(name)}

    assert callers == ["materialize.io.executor"]
    assert {"materialize.loading", "materialize.api", "materialize.conversion"} <= users


def test_the_generic_executor_asks_nothing_of_hugging_face():
    # Hugging Face specifics reach a load through the model's defaults (loading.planned), not the read path.
    reaching = sorted(f"{name} imports {target}" for name in MODULES if name.startswith("materialize.io")
                      for target in imported_modules(name) if target in ("materialize.integrations.hf",
                                                                         "materialize.integrations.hub"))

    assert reaching == []


def reaching(prefix: str, folders: tuple[str, ...]) -> list[str]:
    """``"<module> imports <target>"`` for each module under ``prefix`` importing a module of one of ``folders``."""
    return sorted(f"{name} imports {target}" for name in MODULES if name == prefix or name.startswith(f"{prefix}.")
                  for target in imported_modules(name) if "." in target and target.split(".")[1] in folders)


def test_the_readers_know_bytes_and_formats_only():
    # A reader turns bytes (sources/) into TensorInfos; what a load does with them, models, frameworks' names sit above.
    assert reaching("materialize.checkpoint", ("io", "planning", "skeleton", "integrations")) == []


def test_hugging_face_conventions_ask_nothing_of_the_planner_or_the_skeleton():
    # integrations/hf says what transformers decides (names, dtypes, inits); planning and skeleton ask it, not back.
    assert reaching("materialize.integrations.hf", ("planning", "skeleton")) == []


MAX_PARAMETERS = 8


def exported_functions() -> set[tuple[str, str]]:
    """(module, name) of each public name ``materialize/__init__.py``'s ``_EXPORTS`` maps to its module."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return {(f"materialize.{module}", name) for name, module in ast.literal_eval(node.value).items()}
    raise AssertionError("materialize/__init__.py has no _EXPORTS")


def test_no_internal_function_takes_more_than_eight_parameters():
    # Past eight, a call is read by counting: what travels together becomes one object, or the function splits.
    # The public verbs (load, plan, load_tensors, convert) take many keyword options by design, as the API, and build
    # options.py's objects once; so the rule holds for every function but those __init__ exports (methods included,
    # self and cls, *args and **kwargs not counted).
    public = exported_functions()
    crowded = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
        exported = [node for node in tree.body if node in functions and (name, node.name) in public]
        for node in functions:
            arguments = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
            count = len(arguments) - (arguments[:1] in (["self"], ["cls"]))
            if count > MAX_PARAMETERS and node not in exported:
                crowded.append(f"{name}.{node.name} takes {count}")

    assert crowded == []
