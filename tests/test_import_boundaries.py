"""The packages' boundaries: one-way data flow, public names only, a thin runtime, no import-order trap.

Static checks read the sources (every import, also those inside functions); the runtime and BLAS
checks run a fresh interpreter, since this one has imported everything already.
"""

from __future__ import annotations

import ast
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipeline"
PACKAGES = sorted(p.name for p in PIPELINE.iterdir() if (p / "__init__.py").is_file())
# Code outside pipeline/ that uses it as a library, and must keep to the same public names.
USERS = [
    ROOT / "build.py",
    ROOT / ".github/scripts/release.py",
    *sorted((ROOT / "examples").glob("*.py")),
]
USERS += sorted((ROOT / "bench").glob("*.py"))
# What each package may import from the others (the data flow of docs/architecture.md).
MAY_IMPORT = {
    "format": set(),
    "runtime": {"format"},
    "builder": {"format", "runtime", "testmodels"},
    "distribute": {"format", "runtime", "builder"},
    "testmodels": {"format"},
}
TOP_LEVEL = {p.stem for p in PIPELINE.glob("*.py") if p.stem != "__init__"}  # blas, reexec, ...
NEVER_IN_RUNTIME = (
    "pipeline.builder",
    "pipeline.cli",
    "pipeline.distribute",
    "jinja2",
    "transformers",
)


def package_of(path: Path) -> str | None:
    parts = path.relative_to(ROOT).parts
    return parts[1] if parts[0] == "pipeline" and len(parts) > 2 else None


def imports(path: Path) -> list[tuple[str, str | None, int]]:
    """(module, imported name or None, line) for every import in a file, nested ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.module, a.name, node.lineno) for a in node.names]
    return found


def public(package: str) -> set[str]:
    """The package's __all__ (names and public modules), read from its __init__.py."""
    tree = ast.parse((PIPELINE / package / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def sources() -> list[Path]:
    return sorted(PIPELINE.rglob("*.py")) + USERS


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_says_what_it_exports(package: str):
    names = public(package)
    assert names, f"pipeline/{package}/__init__.py has no __all__"
    folder = PIPELINE / package
    init = (folder / "__init__.py").read_text(encoding="utf-8")
    missing = [
        n
        for n in sorted(names)
        if not (folder / f"{n}.py").is_file()
        and not (folder / n / "__init__.py").is_file()
        and f" {n}" not in init  # imported or defined in __init__
    ]
    assert missing == [], f"pipeline/{package}.__all__ names what it does not have"


def test_nothing_reaches_into_another_package():
    """Across packages: only names or modules in the target's __all__, never a _private one."""
    exported = {p: public(p) for p in PACKAGES}
    bad = []
    for path in sources():
        own = package_of(path)
        for module, name, line in imports(path):
            parts = module.split(".")
            if parts[0] != "pipeline" or len(parts) < 2 or parts[1] in (own, *TOP_LEVEL):
                continue
            inner = parts[2] if len(parts) > 2 else None
            shown = f"{path.relative_to(ROOT)}:{line}: {module}{f' import {name}' if name else ''}"
            if (name or "").startswith("_") or (inner or "").startswith("_"):
                bad.append(f"{shown} (private)")
            elif (inner or name) is not None and not {inner, name} & exported[parts[1]]:
                bad.append(f"{shown} (not in pipeline.{parts[1]}.__all__)")
    assert bad == []


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_data_flows_one_way(package: str):
    allowed = MAY_IMPORT[package] | {package} | TOP_LEVEL
    bad = sorted(
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in (PIPELINE / package).rglob("*.py")
        for module, _, line in imports(path)
        if module.startswith("pipeline.")
        and module.split(".")[1] not in allowed
        or package in ("runtime", "format")
        and module.startswith(("jinja2", "transformers"))
    )
    assert bad == []


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter in the repo root, without this process's preload or BLAS override."""
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PREFIX_BUNDLES_OPENBLAS")
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_importing_the_runtime_only_imports():
    """No build side, no jinja2/transformers/mlx_lm, no OpenBLAS loaded, no environment change."""
    code = (
        "import os, sys; before = dict(os.environ)\n"
        "import pipeline.runtime, pipeline.runtime.serve, pipeline.format.validate\n"
        "from pipeline.blas import mapped_libraries\n"
        f"heavy = [m for m in sys.modules if m.startswith({NEVER_IN_RUNTIME!r} + ('mlx_lm',))]\n"
        "blas = [m for m in mapped_libraries() if os.path.basename(m).startswith('libopenblas')]\n"
        "print(heavy, blas, dict(os.environ) == before)\n"
    )
    done = run_python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[] [] True\n"


linux_openblas = pytest.mark.skipif(
    platform.system() != "Linux" or not __import__("pipeline.blas").blas.find_openblas(),
    reason="needs Linux with a system OpenBLAS (apt-get install libopenblas0-pthread)",
)
SHOW_BLAS = (
    "from pipeline.blas import mapped_libraries\n"
    "import os\n"
    "print(s.notice)\n"
    "print(any(os.path.basename(m).startswith('libopenblas') for m in mapped_libraries()))\n"
)


@linux_openblas
def test_blas_before_mlx_is_loaded_in_process():
    code = "from pipeline.blas import ensure_fast_blas\ns = ensure_fast_blas()\nimport mlx.core\n"
    done = run_python(code + SHOW_BLAS)
    assert done.returncode == 0, done.stderr
    notice, mapped = done.stdout.splitlines()
    assert notice.endswith("(loaded before mlx)") and mapped == "True"


@linux_openblas
def test_blas_after_mlx_re_executes_once_with_the_preload():
    code = "import sys, mlx.core\nfrom pipeline.blas import ensure_fast_blas\ns = ensure_fast_blas(sys.argv[1:])\n"
    done = run_python(code + SHOW_BLAS)
    assert done.returncode == 0, done.stderr
    notice, mapped = done.stdout.splitlines()
    assert notice.endswith("(preloaded)") and mapped == "True"


@linux_openblas
def test_blas_re_execution_does_not_loop_when_the_preload_fails(tmp_path: Path):
    not_a_library = tmp_path / "libopenblas.so.0"
    not_a_library.write_text("not a library\n")
    code = "import sys, mlx.core\nfrom pipeline.blas import ensure_fast_blas\ns = ensure_fast_blas(sys.argv[1:])\n"
    done = run_python(code + SHOW_BLAS, PREFIX_BUNDLES_OPENBLAS=str(not_a_library))
    assert done.returncode == 0, done.stderr
    notice, mapped = done.stdout.splitlines()
    assert notice.endswith(
        f"re-executed with LD_PRELOAD={not_a_library} but it is not loaded; mlx-cpu's own BLAS is in use"
    )
    assert mapped == "False" and done.stderr.count("cannot be preloaded") == 1  # ld.so, once


def test_blas_is_left_alone_without_the_library():
    code = (
        "import sys, os, mlx.core\nfrom pipeline.blas import ensure_fast_blas\npid = os.getpid()\n"
    )
    code += "s = ensure_fast_blas(sys.argv[1:])\nprint(os.getpid() == pid, s.active, s.notice)\n"
    done = run_python(code, PREFIX_BUNDLES_OPENBLAS="/nonexistent/libopenblas.so.0")
    assert done.returncode == 0, done.stderr
    if platform.system() == "Linux":
        assert done.stdout.startswith("True False BLAS: no system OpenBLAS found; float32 prefill")


@linux_openblas
def test_the_example_gets_openblas_although_it_imports_mlx_first(
    tmp_path: Path, shop_bundle: Path, tiny_model: Path
):
    """Its module body (load, mount) in a fresh `python -c`, which re-executes once."""
    example = ROOT / "examples" / "custom_server.py"
    source = example.read_text(encoding="utf-8")
    assert source.index("from mlx_lm import") < source.index("ensure_fast_blas(")  # mlx first
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "demo-tiny").symlink_to(tiny_model)  # the example's defaults
    (tmp_path / "bundles").symlink_to(shop_bundle.parents[2])
    code = (
        "import os, runpy\n"
        f"g = runpy.run_path({str(example)!r}, run_name='example')\n"
        "print(g['BLAS'].notice, [b.name for b in g['mounted'].bundles], os.environ['LD_PRELOAD'])\n"
    )
    clean = {
        k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "PREFIX_BUNDLES_OPENBLAS")
    }
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    notice, mounted, preload = done.stdout.strip().rsplit(" ", 2)
    assert notice.endswith("(preloaded)") and mounted == "['shop@1']"
    assert os.path.realpath(preload) == os.path.realpath(
        __import__("pipeline.blas").blas.find_openblas()
    )


SERVERS = PIPELINE / "runtime" / "servers"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PIPELINE.rglob("*.py"))}


def resolved(module: str, name: str | None) -> str | None:
    """The pipeline module an import loads (`from a import b`: the submodule a.b where it is one)."""
    for candidate in (f"{module}.{name}" if name else None, module):
        while candidate:
            if candidate in MODULES:
                return candidate
            candidate = candidate.rpartition(".")[0]
    return None


def import_graph(nested: bool) -> dict[str, set[str]]:
    """pipeline module -> the pipeline modules it imports (at module level, or anywhere)."""
    graph = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        nodes = ast.walk(tree) if nested else tree.body
        found = set()
        for node in nodes:
            if isinstance(node, ast.Import):
                found |= {resolved(a.name, None) for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {resolved(node.module, a.name) for a in node.names}
        graph[name] = found - {None, name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (as the modules on it, first repeated last)."""
    state: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def walk(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                walk(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            walk(node)
    return found


# imports inside a function that close a cycle (the CLI's: cli.common asks the command table)
KNOWN_LAZY = {("pipeline.cli.common", "pipeline.cli")}


def test_no_import_cycle_in_pipeline():
    """No module of pipeline/ imports itself back, at module level nor through an import inside
    a function (issue 49: servers/__init__ -> startup -> mounted -> snapshots -> servers/__init__
    was one, carried by a lazy import)."""
    assert cycles(import_graph(nested=False)) == []
    graph = import_graph(nested=True)
    for module, target in KNOWN_LAZY:
        graph[module].discard(target)
    assert cycles(graph) == []


def registry():
    from pipeline.runtime.servers import registry

    return registry


def room_of(module: str) -> str | None:
    """The server whose room holds a module (None: outside every room)."""
    rooms = registry().ROOMS
    return next((s for s, r in rooms.items() if module == r or module.startswith(r + ".")), None)


def server_packages(hook: type) -> tuple[str, ...]:
    """The modules only that server's room may import: what its distribution installs, or (a
    server of a library everyone uses, mlx_lm.server) its server module."""
    return hook.ships or (hook.package,)


def test_every_room_is_a_package_whose_hook_the_registry_lists():
    from pipeline.format.manifest import SERVER_NAMES

    reg = registry()
    assert reg.names() == SERVER_NAMES  # what a manifest may record: the format's one list
    rooms = {module_name(p.parent) for p in SERVERS.glob("*/__init__.py")}
    assert rooms == set(reg.ROOMS.values())
    for server in reg.names():
        assert reg.hook_class(server).name == server


# outside the rooms on purpose: the builder checks a definition's messages as the default server
# does (its message processing, called, never copied)
KNOWN_OUTSIDE = {("pipeline/builder/request.py", "mlx_lm.server")}


def test_what_only_one_server_runs_lives_in_its_room():
    """Nothing outside a server's room imports that server's packages (imports inside functions
    too); no room imports another room, and nothing in pipeline/ imports a room (the registry
    names them as strings); a module of servers/ outside the rooms that a room uses is used by
    at least two rooms or by the start-up sequence (a shared family, or the core)."""
    reg = registry()
    owners = {}
    for server in reg.names():
        for package in server_packages(reg.hook_class(server)):
            owners.setdefault(package, set()).add(server)
    problems = []
    for path in sources():
        mine = room_of(module_name(path)) if path.is_relative_to(PIPELINE) else None
        for module, name, line in imports(path):
            where = f"{path.relative_to(ROOT)}:{line}: {module}"
            for package, servers in owners.items():
                ours = module == package or module.startswith(package + ".")
                known = (str(path.relative_to(ROOT)), module) in KNOWN_OUTSIDE
                if ours and mine not in servers and not known:
                    problems.append(f"{where} ({' or '.join(sorted(servers))}'s package)")
            theirs = room_of(resolved(module, name) or "")
            if theirs is not None and theirs != mine:
                problems.append(f"{where} (the room of {theirs})")
    assert problems == []
    graph = import_graph(nested=True)

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    core = reached("pipeline.runtime.servers.startup") | reached("pipeline.runtime.serve")
    users: dict[str, set[str]] = {}
    for module in MODULES:
        if room_of(module) is not None:
            for used in reached(module):
                users.setdefault(used, set()).add(room_of(module))
    alone = {
        m: sorted(u)
        for m, u in users.items()
        if m.startswith("pipeline.runtime.servers.") and room_of(m) is None
        and m not in core and len(u) < 2
    }  # fmt: skip
    assert alone == {}, "move these into the one room that uses them"


def test_no_module_but_the_registry_and_the_format_lists_server_names():
    """A server's name appears as a string in its own room, the registry and the format's one
    definition; elsewhere at most the default server is named (mlx-lm, also its library's
    name), never a list of them: adding a server touches no other module."""
    reg = registry()
    allowed = {"pipeline.runtime.servers.registry", "pipeline.format.manifest"}
    found = {}
    for name, path in MODULES.items():
        if name in allowed:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        named = {
            n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in reg.ROOMS
        }
        server = room_of(name)
        named -= {server, reg.names()[0]} if server else {reg.names()[0]}
        if named:
            found[name] = sorted(named)
    assert found == {}


def test_the_pyproject_extras_are_the_hooks_pins():
    import tomllib

    reg = registry()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for server in reg.names():
        hook = reg.hook_class(server)
        if hook.distribution is None:
            assert hook.extra is None, server
            continue
        assert extras[hook.extra] == [hook.distribution], server


def shape(function) -> list:
    """A function's parameters as a caller sees them: names and kinds."""
    import inspect

    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


def test_every_listed_server_has_one_hook_declaring_what_it_differs_by():
    """A room defines `Hook`, a ServerHook for its server's name, declaring its package and
    address, overriding only the declared points, with their signatures (so the one start-up
    sequence can call any hook the same way); no room imports runtime/serve.py (the dispatch)."""
    import importlib

    from pipeline.runtime.servers.hook import ServerHook

    reg = registry()
    points = {n for n in vars(ServerHook) if not n.startswith("_")} | set(
        ServerHook.__annotations__
    )
    for name, module in reg.ROOMS.items():
        hook = reg.hook_for(name)
        assert isinstance(hook, ServerHook) and hook.name == name, module
        assert isinstance(hook.package, str) and isinstance(hook.address, tuple), module
        declared = {n for n in vars(type(hook)) if not n.startswith("_")}
        assert declared <= points, f"{module} declares {declared - points}"
        for point in declared & set(vars(ServerHook)):
            ours, base = getattr(type(hook), point), getattr(ServerHook, point)
            if callable(base):
                assert shape(ours) == shape(base), f"{module}.{point}"
        assert not hasattr(importlib.import_module(module), "run"), module
    assert importlib.import_module("pipeline.runtime.serve").__all__ == ["serve"]
    graph = import_graph(nested=True)
    assert not [m for m in graph if room_of(m) and "pipeline.runtime.serve" in graph[m]]


def test_what_each_server_can_do_is_read_from_its_hook():
    from pipeline.format.manifest import SERVER_NAMES
    from pipeline.runtime.servers.tokens import anthropic_servers, request_code_servers

    assert request_code_servers() == [n for n in SERVER_NAMES if n != "rapid-mlx"]
    assert anthropic_servers() == ["vllm-mlx"]


def test_no_fast_test_uses_a_server_venv():
    """.ci/run makes the server venvs while `just test` runs: a test not marked slow that asks for
    one would find it missing or half made. Checked on the source: every test function that names
    servers_python, rapid_python or the other-minor venv (other_python) is marked slow."""
    import ast

    venv_names = {"servers_python", "rapid_python", "other_python"}
    offenders = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        module_slow = "pytest.mark.slow" in path.read_text().split("\ndef ", 1)[0]
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test_"):
                continue
            slow = module_slow or any("slow" in ast.unparse(d) for d in node.decorator_list)
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            names |= {a.arg for a in node.args.args}
            if not slow and names & venv_names:
                offenders.append(f"{path.name}::{node.name}")
    assert not offenders, f"mark these slow (they use a server venv): {offenders}"
