"""`pdflow/_native.pyi` declares exactly what `pdflow._native` exposes: every public name of the
module, every public method and attribute of its classes (and nothing the module lacks), each of
the right kind, with the parameters the Rust half takes. A `#[pyfunction]`, a `#[pymethods]`
method, a getter or a parameter added, renamed or removed in ``py-bridge/src`` without the stub
fails here. Names starting with ``_`` are the stub's typing helpers (and the module's dunders),
except ``__version__`` and ``__init__``, which are checked.
"""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path
from typing import Any, Optional

from pdflow import _native

STUB = Path(__file__).resolve().parents[1] / "python" / "pdflow" / "_native.pyi"

#: Dunder names the stub must declare when the module has them, and may declare only then.
CHECKED_DUNDERS = {"__version__", "__init__"}


def public(name: str) -> bool:
    return not name.startswith("_") or name in CHECKED_DUNDERS


def stub_parameters(fn: ast.FunctionDef) -> list[tuple[str, str, bool, Any]]:
    """``(name, kind, has_default, default)`` of each parameter but ``self``."""
    a = fn.args
    positional = [(p, "POSITIONAL_ONLY") for p in a.posonlyargs] + [(p, "POSITIONAL_OR_KEYWORD") for p in a.args]
    defaults: list[Optional[ast.expr]] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    out = []
    for (p, kind), default in zip(positional, defaults):
        out.append((p.arg, kind, default is not None, default))
    for p, default in zip(a.kwonlyargs, a.kw_defaults):
        out.append((p.arg, "KEYWORD_ONLY", default is not None, default))
    if a.vararg is not None:
        out.append((a.vararg.arg, "VAR_POSITIONAL", False, None))
    if a.kwarg is not None:
        out.append((a.kwarg.arg, "VAR_KEYWORD", False, None))
    if out and out[0][0] in ("self", "cls"):
        out = out[1:]
    return out


def runtime_parameters(obj: Any) -> Optional[list[tuple[str, str, bool, Any]]]:
    """The same for a native function, method or class (its constructor); None without a signature."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = list(sig.parameters.values())
    if params and params[0].name in ("self", "cls"):
        params = params[1:]
    return [(p.name, p.kind.name, p.default is not inspect.Parameter.empty, p.default) for p in params]


def compare_parameters(where: str, declared: ast.FunctionDef, obj: Any) -> list[str]:
    actual = runtime_parameters(obj)
    if actual is None:
        return [f"{where}: the module gives no signature to check the stub's against"]
    want = stub_parameters(declared)
    problems = []
    if [(n, k) for n, k, _, _ in want] != [(n, k) for n, k, _, _ in actual]:
        return [f"{where}: the stub declares ({_render(want)}), the module takes ({_render(actual)})"]
    for (name, _, stub_has, stub_default), (_, _, has, default) in zip(want, actual):
        if stub_has != has:
            problems.append(f"{where}: parameter {name!r} has a default in {'the stub' if stub_has else 'the module'} only")
        elif has and default is not Ellipsis:
            try:
                value = ast.literal_eval(stub_default)
            except ValueError:
                continue
            if value != default:
                problems.append(f"{where}: parameter {name!r} defaults to {default!r}, the stub says {value!r}")
    return problems


def _render(params: list[tuple[str, str, bool, Any]]) -> str:
    return ", ".join(f"{'*' if k == 'KEYWORD_ONLY' else ''}{n}{'=…' if d else ''}" for n, k, d, _ in params)


def is_property(fn: ast.FunctionDef) -> bool:
    return any(isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list)


def declared_names(body: list[ast.stmt]) -> dict[str, ast.stmt]:
    names: dict[str, ast.stmt] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
    return names


def compare_class(name: str, declared: ast.ClassDef, cls: type, stub: dict[str, ast.stmt]) -> list[str]:
    problems = []
    for base in declared.bases:
        if isinstance(base, ast.Name):
            owner = _native if base.id in stub else builtins
            expected = getattr(owner, base.id, None)
            if isinstance(expected, type) and not issubclass(cls, expected):
                problems.append(f"{name}: the stub derives it from {base.id}, the module does not")
    members = {n: node for n, node in declared_names(declared.body).items() if public(n)}
    runtime = {n for n in vars(cls) if public(n)}
    if "__init__" in members or "__new__" in vars(cls):
        runtime.add("__init__")
    for missing in sorted(runtime - members.keys()):
        problems.append(f"{name}.{missing}: exposed by the module, not declared in the stub")
    for extra in sorted(members.keys() - runtime):
        problems.append(f"{name}.{extra}: declared in the stub, not exposed by the module")
    for member in sorted(members.keys() & runtime):
        node, where = members[member], f"{name}.{member}"
        if member == "__init__":
            if isinstance(node, ast.FunctionDef):
                problems += compare_parameters(where, node, cls)
            continue
        value = vars(cls)[member]
        is_attribute = inspect.isdatadescriptor(value)
        if isinstance(node, ast.AnnAssign) or (isinstance(node, ast.FunctionDef) and is_property(node)):
            if not is_attribute:
                problems.append(f"{where}: an attribute in the stub, not in the module")
        elif isinstance(node, ast.FunctionDef):
            if is_attribute or not callable(value):
                problems.append(f"{where}: a method in the stub, not in the module")
            else:
                problems += compare_parameters(where, node, value)
    return problems


def stub_drift(stub_text: str) -> list[str]:
    """What differs between a stub's text and the module, one line per difference."""
    stub = declared_names(ast.parse(stub_text).body)
    declared = {n: node for n, node in stub.items() if public(n)}
    exposed = {n for n in dir(_native) if public(n)}
    problems = [f"{n}: exposed by pdflow._native, not declared in the stub" for n in sorted(exposed - declared.keys())]
    problems += [f"{n}: declared in the stub, not exposed by pdflow._native" for n in sorted(declared.keys() - exposed)]
    for name in sorted(declared.keys() & exposed):
        node, value = declared[name], getattr(_native, name)
        if isinstance(node, ast.ClassDef):
            if not isinstance(value, type):
                problems.append(f"{name}: a class in the stub, a {type(value).__name__} in the module")
            else:
                problems += compare_class(name, node, value, stub)
        elif isinstance(node, ast.FunctionDef):
            if isinstance(value, type) or not callable(value):
                problems.append(f"{name}: a function in the stub, a {type(value).__name__} in the module")
            else:
                problems += compare_parameters(name, node, value)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.annotation, ast.Name):
            expected = {"str": str, "bool": bool, "int": int, "float": float}.get(node.annotation.id)
            if expected is not None and type(value) is not expected:
                problems.append(f"{name}: {node.annotation.id} in the stub, {type(value).__name__} in the module")
    return problems


def test_the_stub_declares_exactly_what_the_module_exposes():
    problems = stub_drift(STUB.read_text())
    assert not problems, "py-bridge/python/pdflow/_native.pyi has drifted from py-bridge/src:\n  " + "\n  ".join(problems)


def test_decode_metadata_returns_the_keys_the_stub_declares():
    view = declared_names(ast.parse(STUB.read_text()).body)["_MetadataView"]
    assert isinstance(view, ast.ClassDef)
    declared = {n for n, node in declared_names(view.body).items() if isinstance(node, ast.AnnAssign)}
    assert set(_native.decode_metadata(b"")) == declared


def test_drift_is_caught():
    """The check itself: a stub that lost a method, gained a name, renamed a parameter, lost a
    default or declares an attribute as a method is reported, each by name."""
    text = STUB.read_text()
    assert not stub_drift(text)
    drifts = {
        "bind_reqs_to_save": text.replace("    def bind_reqs_to_save(self, metadata: bytes) -> None: ...\n", ""),
        "not_in_the_module": text + "\ndef not_in_the_module() -> None: ...\n",
        "frame_bytes": text.replace("def decode_metadata(frame_bytes: bytes)", "def decode_metadata(frame: bytes)"),
        "extra_config_json": text.replace('extra_config_json: str = "",\n        kv_groups', "extra_config_json: str,\n        kv_groups"),
        "launches_bootstrap": text.replace(
            "    @property\n    def launches_bootstrap(self) -> bool:", "    def launches_bootstrap(self) -> bool:"
        ),
        "GPU_KV": text.replace("GPU_KV: bool", "GPU_KV: str"),
    }
    for name, drifted in drifts.items():
        assert drifted != text, f"the drift of {name} did not apply to the stub"
        problems = stub_drift(drifted)
        assert any(name in p for p in problems), f"{name}: drift not caught ({problems})"
