"""Which config fields the runtime code reads, each by the path of the section that holds it: a small static type
inference over the code's AST, for tests/test_config_keys.py.

A search for bare names counts `trainer.critic.micro_batch_size_per_gpu` as read as soon as the actor's
`t.micro_batch_size_per_gpu` is, and an auxiliary model's `enable_openai_api` as soon as the rollout model's is.
Here every attribute load is typed instead: after `rm = cfg.explorer.rollout_model`, `rm.enable_openai_api` reads
`explorer.rollout_model.enable_openai_api` and nothing else. Types come from

- annotations (`cfg: configs.Config`, `ts: TasksetConfig`, `list[TasksetConfig]`, a field `cfg: configs.Config` of a
  runtime class such as train.Parts): a schema class stands for every path where it appears in the schema;
- the call sites of a function whose parameter has no annotation (`make_engine(aux, ...)`), and else, for an
  unannotated parameter named `cfg`, the root Config (the project's convention);
- assignments (tuple ones too), `self.x = ...` in a method, `for` targets and comprehensions (lists, tuples,
  `enumerate`, `zip`, `.items()`, `.values()`), `getattr(x, "name")` and `getattr(x, k)` for `k` from a tuple of
  strings, `dataclasses.replace` / `copy.deepcopy`, the return annotation of the function or class called.

Paths: `explorer.auxiliary_models[].model_path` (any element of a list), `buffer.trainer_input.auxiliary_buffers.*.path`
(any value of a dict). A load whose base has no type counts only for a field name that exists at one path of the
schema (so `x.name` on some object never reads `trainer.name`): a shared name must be read through a typed base.
The args of algos/ pieces (their Config) and of workflows (their Args) are sections too, at `<module.Class>`, read
only through a typed base (`cfg: Config` in a piece; `pieces[kind][1]` of an `algos.Pieces`, the Configs of that
kind's registry; a workflow's `self.args`, typed by its `Args = ...`).
"""

from __future__ import annotations

import ast
import dataclasses
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import configs
import configs.schema as schema
import workflows
from algos import REGISTRIES
from configs.schema import Config
from workflows import WORKFLOWS

# --- the schema: section path -> class, the paths of every field


def _unwrap(tp: Any) -> tuple[str, Any]:
    """('one' | 'list' | 'dict', dataclass) for a section-typed hint, else ('', None)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _unwrap(args[0])
    if dataclasses.is_dataclass(tp):
        return "one", tp
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return "list", args[0]
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return "dict", args[1]
    if origin in (typing.Union, types.UnionType):
        for a in args:
            kind, cls = _unwrap(a)
            if cls is not None:
                return kind, cls
    return "", None


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _sections(cls: type = Config, path: str = "", out: dict[str, type] | None = None) -> dict[str, type]:
    out = {} if out is None else out
    out[path] = cls
    for name, tp in typing.get_type_hints(cls, include_extras=True).items():
        kind, inner = _unwrap(tp)
        if inner is not None:
            _sections(inner, _join(path, name) + {"one": "", "list": "[]", "dict": ".*"}[kind], out)
    return out


SECTIONS = _sections()  # "explorer.auxiliary_models[]" -> InferenceModelConfig; "" -> Config
FIELD_PATHS = {_join(p, f.name): (cls, f.name) for p, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
PATHS_OF_NAME: dict[str, set[str]] = {}
for _path, (_cls, _name) in FIELD_PATHS.items():
    PATHS_OF_NAME.setdefault(_name, set()).add(_path)
# a schema class by its qualified names (where defined, and re-exported by configs / configs.schema) -> its paths
CLASS_QN: dict[str, frozenset[str]] = {}
for _path, _cls in SECTIONS.items():
    _qn = f"{_cls.__module__}.{_cls.__qualname__}"
    CLASS_QN[_qn] = CLASS_QN.get(_qn, frozenset()) | {_path}


# --- the args of algos/ pieces (their Config: algorithm.<kind>_args) and of workflows (their Args: workflow_args):
# sections of their own at "<module.Class>" (a class may serve several registry names), so that `cfg.clip_range` in
# algos/ppo_loss.py reads ppo_loss.Config's clip_range and a workflow's `self.args.tools` its Args' tools, and
# nothing else does (`task.tools` is not ToolArgs.tools). A field is named by the class that declares it (ToolArgs'
# system_prompt is WorkflowArgs'); a workflow's `self.args` has the type of its class's `Args = ...`.


def args_path(cls: type) -> str:
    return f"<{cls.__module__}.{cls.__qualname__}>"


def _declaring(cls: type, name: str) -> type:
    return next(
        c for c in reversed(cls.__mro__) if name in getattr(c, "__annotations__", {}) and dataclasses.is_dataclass(c)
    )


ARG_CLASSES = {c for registry in REGISTRIES.values() for _, c in registry.values()} | {
    wf.Args for wf in WORKFLOWS.values() if wf.Args is not None
}
ARG_FIELD_PATHS: dict[str, str] = {}  # "<workflows.tool_use.ToolArgs>.system_prompt" -> "<workflows.args.Work...
for _cls in ARG_CLASSES:
    SECTIONS[args_path(_cls)] = _cls
    CLASS_QN[f"{_cls.__module__}.{_cls.__qualname__}"] = frozenset({args_path(_cls)})
    for _f in dataclasses.fields(_cls):
        ARG_FIELD_PATHS[_join(args_path(_cls), _f.name)] = _join(args_path(_declaring(_cls, _f.name)), _f.name)
for _mod in (configs, schema, workflows):
    for _name, _obj in vars(_mod).items():
        if isinstance(_obj, type) and f"{_obj.__module__}.{_obj.__qualname__}" in CLASS_QN:
            CLASS_QN[f"{_mod.__name__}.{_name}"] = CLASS_QN[f"{_obj.__module__}.{_obj.__qualname__}"]

# --- types: ("sec", paths) a section at one of these paths; ("list", T) / ("dict", T) of T values; ("tuple", (T, ...));
# ("struct", "module.Class") an object of a class of the runtime code; ("strs", strings) a string among these;
# None: unknown

Type = Any


def union(a: Type, b: Type) -> Type:
    if a is None or b is None:
        return a if b is None else b
    if a[0] != b[0]:
        return None
    if a[0] in ("sec", "strs"):
        return a[0], a[1] | b[1]
    if a[0] in ("list", "dict"):
        return a[0], union(a[1], b[1])
    if a[0] == "tuple" and len(a[1]) == len(b[1]):
        return "tuple", tuple(union(x, y) for x, y in zip(a[1], b[1]))
    return a if a == b else None


def element(t: Type) -> Type:
    """What iterating a value of type t gives."""
    if t is None:
        return None
    if t[0] == "list":
        return t[1]
    if t[0] == "tuple":
        out = None
        for x in t[1]:
            out = union(out, x)
        return out
    return None


def section_field(paths: frozenset[str], attr: str) -> Type:
    out: Type = None
    for p in paths:
        hints = typing.get_type_hints(SECTIONS[p], include_extras=True)
        kind, inner = _unwrap(hints[attr]) if attr in hints else ("", None)
        if inner is not None:
            sub: Type = ("sec", frozenset({_join(p, attr) + {"one": "", "list": "[]", "dict": ".*"}[kind]}))
            out = union(out, sub if kind == "one" else (kind, sub))
    return out


# --- modules: imports, classes, functions


@dataclasses.dataclass
class Module:
    name: str  # "train", "algos.ppo_loss"
    tree: ast.Module
    imports: dict[str, str]  # local name -> "module" or "module.attr"
    functions: dict[str, ast.FunctionDef]  # module-level ones
    classes: dict[str, ast.ClassDef]


def load_modules(root: Path, files: list[Path]) -> dict[str, Module]:
    mods = {}
    for f in files:
        name = ".".join(f.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        tree = ast.parse(f.read_text())
        imports: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    imports[a.asname or a.name] = f"{node.module}.{a.name}"
        functions = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        mods[name] = Module(name, tree, imports, functions, classes)
    return mods


def qualified(node: ast.expr, mod: Module) -> str:
    """'configs.Config' for `configs.Config`, 'configs.schema.TasksetConfig' for an imported `TasksetConfig`,
    'train.Parts' for a class of train.py, ..."""
    if isinstance(node, ast.Name):
        return mod.imports.get(node.id, f"{mod.name}.{node.id}")
    if isinstance(node, ast.Attribute):
        return f"{qualified(node.value, mod)}.{node.attr}"
    return ""


CONTAINERS = {
    "list": "list",
    "List": "list",
    "Sequence": "list",
    "Iterable": "list",
    "Iterator": "list",
    "set": "list",
    "dict": "dict",
    "Dict": "dict",
    "Mapping": "dict",
}


def annotation_type(node: ast.expr | None, mod: Module | None) -> Type:
    if node is None or mod is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return annotation_type(ast.parse(node.value, mode="eval").body, mod)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        return annotation_type(node.left, mod) or annotation_type(node.right, mod)
    if isinstance(node, ast.Subscript):
        outer = qualified(node.value, mod).rsplit(".", 1)[-1]
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if outer in CONTAINERS:
            return CONTAINERS[outer], annotation_type(args[-1], mod)
        if outer in ("tuple", "Tuple"):
            return "tuple", tuple(annotation_type(a, mod) for a in args)
        return annotation_type(args[0], mod) if outer in ("Optional", "Annotated") else None
    q = qualified(node, mod)
    if q == "algos.Pieces":  # a trainer's pieces by kind: pieces["kl_loss_fn"][1] is a KL piece's Config
        return "pieces", None
    return ("sec", CLASS_QN[q]) if q in CLASS_QN else ("struct", q) if q else None


def piece_type(kinds: Type) -> Type:
    """(function, Config) of algos.Pieces[kind] for a key among `kinds` (strings): the Config of any piece of the
    kinds' registries."""
    if kinds is None or kinds[0] != "strs":
        return None
    paths = frozenset(args_path(c) for k in kinds[1] for _, c in REGISTRIES.get(k, {}).values())
    return ("tuple", (None, ("sec", paths))) if paths else None


# --- the walk


class Reads:
    """Types every name of every function (a few passes: call sites and `self.x` feed other functions), then
    records the reads: `paths`, the field paths read through a typed base; `names`, attributes loaded from a base
    of unknown type."""

    def __init__(self, mods: dict[str, Module]) -> None:
        self.mods = mods
        self.fields: dict[str, dict[str, Type]] = {}  # "module.Class" -> attribute -> type (annotations, self.x =)
        self.params: dict[tuple[str, str], dict[str, Type]] = {}  # (module, function) -> parameter -> call sites' type
        self.paths: set[str] = set()
        self.names: set[str] = set()
        for mod in mods.values():
            for cname, cls in mod.classes.items():
                self.fields[f"{mod.name}.{cname}"] = {
                    n.target.id: annotation_type(n.annotation, mod)
                    for n in cls.body
                    if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                }
                for n in cls.body:  # a workflow's `Args = ToolArgs`: its self.args is a ToolArgs
                    if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == ["Args"]:
                        self.fields[f"{mod.name}.{cname}"]["args"] = annotation_type(n.value, mod)

    def run(self, passes: int = 4) -> Reads:
        for _ in range(passes):
            for mod in self.mods.values():
                self.scope(mod, mod.tree, {}, None)
        return self

    # --- expressions

    def attr(self, t: Type, name: str) -> Type:
        if t is None:
            return None
        if t[0] == "sec":
            return section_field(t[1], name)
        if t[0] == "struct":
            return self.fields.get(t[1], {}).get(name)
        return None

    def callee(self, func: ast.expr, mod: Module) -> tuple[Module, ast.AST] | None:
        """The function or class of this module or an imported one that `func` names."""
        module, _, name = qualified(func, mod).rpartition(".")
        target = self.mods.get(module)
        if target is None and module == "configs":  # re-exports of the configs package
            target = next(
                (m for m in self.mods.values() if m.name.startswith("configs.") and name in m.functions), None
            )
        if target is None:
            return None
        node = target.functions.get(name) or target.classes.get(name)
        return (target, node) if node is not None else None

    def typeof(self, node: ast.expr, env: dict, mod: Module) -> Type:
        if isinstance(node, ast.Name):
            return env.get(node.id)
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return "strs", frozenset({node.value})
        if isinstance(node, ast.Attribute):
            return self.attr(self.typeof(node.value, env, mod), node.attr)
        if isinstance(node, ast.Subscript):
            t = self.typeof(node.value, env, mod)
            if t and t[0] == "pieces":
                return piece_type(self.typeof(node.slice, env, mod))
            if t and t[0] == "tuple" and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
                return t[1][node.slice.value] if -len(t[1]) <= node.slice.value < len(t[1]) else None
            return t[1] if t and t[0] in ("list", "dict") else None
        if isinstance(node, ast.Call):
            return self.call_type(node, env, mod)
        if isinstance(node, ast.IfExp):
            return union(self.typeof(node.body, env, mod), self.typeof(node.orelse, env, mod))
        if isinstance(node, ast.BoolOp):
            out: Type = None
            for v in node.values:
                out = union(out, self.typeof(v, env, mod))
            return out
        if isinstance(node, ast.NamedExpr):
            return self.typeof(node.value, env, mod)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            parts = [
                self.typeof(e.value, env, mod) if isinstance(e, ast.Starred) else self.typeof(e, env, mod)
                for e in node.elts
            ]
            if isinstance(node, ast.Tuple) and not any(isinstance(e, ast.Starred) for e in node.elts):
                return "tuple", tuple(parts)
            out = None
            for e, t in zip(node.elts, parts):
                out = union(out, element(t) if isinstance(e, ast.Starred) else t)
            return "list", out
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return "list", self.comp_env_type(node, node.elt, env, mod)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            a, b = self.typeof(node.left, env, mod), self.typeof(node.right, env, mod)
            if a and b and a[0] == b[0] == "strs":
                return "strs", frozenset(x + y for x in a[1] for y in b[1])
            return union(a, b)
        return None

    def comp_env_type(self, node: ast.AST, elt: ast.expr, env: dict, mod: Module) -> Type:
        inner = dict(env)
        for gen in node.generators:
            self.bind(gen.target, element(self.typeof(gen.iter, inner, mod)), inner)
        return self.typeof(elt, inner, mod)

    def call_type(self, node: ast.Call, env: dict, mod: Module) -> Type:
        f, args = node.func, node.args
        first = self.typeof(args[0], env, mod) if args else None
        name = qualified(f, mod)
        if name.endswith(".getattr") and len(args) >= 2:
            keys = self.typeof(args[1], env, mod)
            out: Type = None
            for k in keys[1] if keys and keys[0] == "strs" else ():
                out = union(out, self.attr(first, k))
            return out
        if name.endswith(("dataclasses.replace", "copy.deepcopy", "copy.copy")):
            return first
        short = name.rsplit(".", 1)[-1]
        if short in ("sorted", "list", "reversed", "tuple") and name == f"{mod.name}.{short}":
            return "list", element(first)
        if short == "enumerate" and name == f"{mod.name}.enumerate":
            return "list", ("tuple", (None, element(first)))
        if short == "zip" and name == f"{mod.name}.zip":
            return "list", ("tuple", tuple(element(self.typeof(a, env, mod)) for a in args))
        if isinstance(f, ast.Attribute) and f.attr in ("items", "values", "get"):
            t = self.typeof(f.value, env, mod)
            value = t[1] if t and t[0] == "dict" else None
            return {"items": ("list", ("tuple", (None, value))), "values": ("list", value), "get": value}[f.attr]
        found = self.callee(f, mod)
        if found is None:
            return None
        target, fn = found
        if isinstance(fn, ast.ClassDef):
            return "struct", f"{target.name}.{fn.name}"
        return annotation_type(fn.returns, target)

    # --- names

    def bind(self, target: ast.expr, t: Type, env: dict, cls: str | None = None) -> None:
        """Give `target` (a name, a tuple of targets, or `self.x` in a method of class `cls`) the type t."""
        if isinstance(target, ast.Name):
            env[target.id] = union(env[target.id], t) if env.get(target.id) is not None else t
        elif isinstance(target, (ast.Tuple, ast.List)):
            parts = t[1] if t and t[0] == "tuple" else [element(t)] * len(target.elts)
            for sub, st in zip(target.elts, parts):
                self.bind(sub, st, env, cls)
        elif (
            isinstance(target, ast.Attribute)
            and isinstance(target.value, ast.Name)
            and target.value.id == "self"
            and cls
            and t is not None
        ):
            got = self.fields.setdefault(cls, {})
            got[target.attr] = union(got[target.attr], t) if got.get(target.attr) is not None else t

    def note_call(self, node: ast.Call, env: dict, mod: Module) -> None:
        """The argument types at a call of a function, class or method of the code: they type its parameters
        (`parameters`)."""
        found, skip = self.callee(node.func, mod), 0
        if found is not None and isinstance(found[1], ast.ClassDef):  # a constructor: its __init__, after self
            target, cls_node = found
            init = next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
            found, skip = ((target, init), 1) if init else (None, 0)
            key = (target.name, f"{cls_node.name}.__init__")
        elif found is not None:
            key = (found[0].name, found[1].name)
        elif isinstance(node.func, ast.Attribute):  # obj.method(...) on an object of a class of the code
            t = self.typeof(node.func.value, env, mod)
            module, _, cname = t[1].rpartition(".") if t and t[0] == "struct" else ("", "", "")
            cls_node = self.mods[module].classes.get(cname) if module in self.mods else None
            fn = (
                next((n for n in cls_node.body if isinstance(n, ast.FunctionDef) and n.name == node.func.attr), None)
                if cls_node
                else None
            )
            found, skip, key = (
                ((self.mods.get(module), fn), 1, (module, f"{cname}.{node.func.attr}")) if fn else (None, 0, ("", ""))
            )
        if found is None or not isinstance(found[1], (ast.FunctionDef, ast.AsyncFunctionDef)):
            return
        fn = found[1]
        names = [a.arg for a in fn.args.posonlyargs + fn.args.args][skip:]
        seen = self.params.setdefault(key, {})
        pairs = list(zip(names, node.args)) + [(k.arg, k.value) for k in node.keywords if k.arg]
        for name, value in pairs:
            if not isinstance(value, ast.Starred):
                t = self.typeof(value, env, mod)
                seen[name] = None if name in seen and (seen[name] is None or t is None) else union(seen.get(name), t)

    def parameters(self, node: ast.AST, mod: Module, env: dict, cls: str | None) -> None:
        args = node.args
        positional = args.posonlyargs + args.args
        for i, a in enumerate(positional + args.kwonlyargs):
            t = annotation_type(a.annotation, mod)
            if t is None and i == 0 and cls and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                t = "struct", cls  # self
            qualname = (
                f"{cls.rpartition('.')[2]}.{node.name}"
                if cls and not isinstance(node, ast.Lambda)
                else getattr(node, "name", "")
            )
            seen = self.params.get((mod.name, qualname), {}).get(a.arg, "none")
            # NOTE: where every call site is typed, its types win over the annotation (narrower: the paths passed)
            if t is None or (seen and seen != "none" and seen[0] == t[0] and t[0] in ("sec", "list", "dict")):
                t = None if seen == "none" else seen
            if t is None and a.arg == "cfg":
                t = "sec", frozenset({""})
            env[a.arg] = t

    def scope(self, mod: Module, node: ast.AST, outer: dict, cls: str | None) -> None:
        """Type the names of one function (or class body, or the module), record its reads, then its nested
        functions (which see its names)."""
        env = dict(outer)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            self.parameters(node, mod, env, cls)
        body = list(own_nodes(node))
        for _ in range(3):  # a name may be used before the walk reaches its assignment
            for n in body:
                if isinstance(n, ast.Assign):
                    for target in n.targets:
                        self.bind(target, self.typeof(n.value, env, mod), env, cls)
                elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                    env[n.target.id] = annotation_type(n.annotation, mod) or (
                        self.typeof(n.value, env, mod) if n.value else None
                    )
                elif isinstance(n, ast.NamedExpr):
                    self.bind(n.target, self.typeof(n.value, env, mod), env)
                elif isinstance(n, (ast.For, ast.AsyncFor)):
                    self.bind(n.target, element(self.typeof(n.iter, env, mod)), env)
                elif isinstance(n, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
                    for gen in n.generators:
                        self.bind(gen.target, element(self.typeof(gen.iter, env, mod)), env)
        for n in body:
            if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load):
                self.record(self.typeof(n.value, env, mod), n.attr)
            elif isinstance(n, ast.Call):
                self.note_call(n, env, mod)
                if qualified(n.func, mod).endswith(".getattr") and len(n.args) >= 2:
                    keys = self.typeof(n.args[1], env, mod)
                    for k in keys[1] if keys and keys[0] == "strs" else ():
                        self.record(self.typeof(n.args[0], env, mod), k)
            elif isinstance(n, ast.ClassDef):
                self.scope(mod, n, env, f"{mod.name}.{n.name}")
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                self.scope(mod, n, env, cls if isinstance(node, ast.ClassDef) else None)

    def record(self, t: Type, attr: str) -> None:
        if t is not None and t[0] == "sec":
            self.paths.update(_join(p, attr) for p in t[1] if _join(p, attr) in FIELD_PATHS)
            self.paths.update(ARG_FIELD_PATHS[_join(p, attr)] for p in t[1] if _join(p, attr) in ARG_FIELD_PATHS)
        elif t is None:
            self.names.add(attr)


def own_nodes(node: ast.AST) -> Iterator[ast.AST]:
    """Every node under `node`, not descending into nested functions and classes (their own scopes; the nested
    definition itself is yielded)."""
    stack = list(ast.iter_child_nodes(node))
    while stack:
        n = stack.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(n))


def read_paths(root: Path, files: list[Path]) -> set[str]:
    """The field paths the code in `files` reads: typed reads (an algos/ piece's or a workflow's args field by its
    declaring class's path, `<algos.ppo_loss.Config>.clip_range`), and untyped loads of names that exist at one path
    of the schema only."""
    r = Reads(load_modules(root, files)).run()
    untyped = {next(iter(PATHS_OF_NAME[n])) for n in r.names if len(PATHS_OF_NAME.get(n, ())) == 1}
    return r.paths | untyped
