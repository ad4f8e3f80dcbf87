"""Command-line flags derived from the frozen config dataclasses, so that a field's default, help
and choices are written once: in its dataclass.

========================  ==========================================================================
help                      the field's one-line ``# comment`` in the class source
default                   the dataclass default (``Flag.default`` where the command decides later)
``Literal[...]``          ``choices``
``bool``                  ``--flag`` / ``--no-flag``
``tuple[str, ...]``       any number of values (a tuple in ``values``)
``int float str Path``    that type; ``X | None`` as ``X``
``ByteSize``              a byte count, also with a unit (``4GiB``, ``512MB``)
========================  ==========================================================================

Help and types are read from the source with ``ast`` (aliases such as ``DType`` followed into the
module they are imported from), never by importing the class: ``defaults=False`` builds flags of a
role's config in a command that passes them on (``epdserve up``) without importing the role, which
would load torch into the supervisor. Only defaults need the class itself.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import io
import operator
import sys
import tokenize
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

_SCALARS: dict[str, type] = {"int": int, "float": float, "str": str, "Path": Path}
_FROM_FIELD = object()  # Flag.default: the dataclass default


@dataclass(frozen=True)
class FieldInfo:
    """What the source says about one field."""

    name: str
    doc: str  # its one-line comment
    kind: Callable[[str], Any]  # int, float, str, Path, bool or tuple (of str); or a parser (ByteSize)
    choices: tuple[str, ...] | None = None  # the values of a Literal type


@dataclass(frozen=True)
class Flag:
    """The command-line flag of one config field."""

    field: str  # the dataclass field the flag sets
    name: str = ""  # the option ("" = prefix + the field name with dashes)
    default: Any = _FROM_FIELD  # the flag's default when it is not the field's (None: the command decides)
    default_help: str = ""  # what a None default stands for, shown as "(default: ...)"
    aliases: tuple[str, ...] = ()  # other option strings, e.g. ("-n",)
    help: str = ""  # its help where the field's comment speaks of another use of the config ("": the comment)

    def option(self, prefix: str) -> str:
        return self.name or prefix + self.field.replace("_", "-")

    def dest(self, prefix: str) -> str:
        return self.option(prefix).lstrip("-").replace("-", "_")


FlagSpec = Flag | str  # a bare field name is Flag(field)


def _flag(spec: FlagSpec) -> Flag:
    return spec if isinstance(spec, Flag) else Flag(spec)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    config: type | str,
    flags: Iterable[FlagSpec],
    prefix: str = "--",
    defaults: bool = True,
) -> None:
    """One flag per entry of ``flags`` for fields of ``config`` (a dataclass, or ``"module:Class"``).

    ``defaults=False``: every flag defaults to None, whatever its field's default, and the class is
    not imported; for flags a command hands on to the process that owns the config only when given."""
    field_defaults = config_defaults(config) if defaults else {}
    for flag in map(_flag, flags):
        f = field_info(config, flag.field)
        default = field_defaults.get(flag.field) if flag.default is _FROM_FIELD else flag.default
        kwargs: dict[str, Any] = {"dest": flag.dest(prefix), "default": default}
        help_text = (flag.help or f.doc).replace("%", "%%")
        # a flag handed on only when given still shows what the role does without it
        declared = None if defaults or flag.default is not _FROM_FIELD else declared_default(config, flag.field)
        if flag.default_help:
            help_text += f" (default: {flag.default_help})"
        elif default not in (None, "", ()):
            help_text += " (default: %(default)s)"
        elif declared not in (None, "", "()"):
            help_text += f" (default: {declared})".replace("%", "%%")
        if f.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.kind is tuple:
            kwargs["nargs"] = "*"
        else:
            kwargs["type"] = f.kind
        if f.choices is not None:
            kwargs["choices"] = f.choices
        parser.add_argument(flag.option(prefix), *flag.aliases, help=help_text, **kwargs)


def values(args: argparse.Namespace, flags: Iterable[FlagSpec], prefix: str = "--") -> dict[str, Any]:
    """``{field: value}`` of the flags ``add_flags`` defined, leaving out those that are None (not
    given, for the command or the config's default to decide); lists become tuples."""
    out: dict[str, Any] = {}
    for flag in map(_flag, flags):
        value = getattr(args, flag.dest(prefix))
        if value is not None:
            out[flag.field] = tuple(value) if isinstance(value, list) else value
    return out


def to_argv(args: argparse.Namespace, flags: Iterable[FlagSpec], prefix: str = "--") -> list[str]:
    """The given flags (not None) as a command line again, to hand them on to another process."""
    argv: list[str] = []
    for flag in map(_flag, flags):
        option, value = flag.option(prefix), getattr(args, flag.dest(prefix))
        if value is None:
            continue
        if isinstance(value, bool):
            argv.append(option if value else "--no-" + option[2:])
        elif isinstance(value, list | tuple):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


# ---- reading the source -----------------------------------------------------------------------------


def _ref(config: type | str) -> str:
    return config if isinstance(config, str) else f"{config.__module__}:{config.__qualname__}"


def config_defaults(config: type | str) -> dict[str, Any]:
    """The defaults of a config dataclass's fields that have one (by name)."""
    cls = config if isinstance(config, type) else _import(config)
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _import(ref: str) -> type:
    module, _, name = ref.partition(":")
    cls: type = getattr(importlib.import_module(module), name)
    return cls


def field_info(config: type | str, name: str) -> FieldInfo:
    """What the source of ``config`` (its own class body, not its bases) says about field ``name``."""
    module, _ = _ref(config).split(":")
    kind, choices = _kind(_declared_field(config, name)[0], module)
    return FieldInfo(name, field_doc(config, name), kind, choices)


def declared_default(config: type | str, name: str) -> str | None:
    """The default of field ``name`` as its source states it, read without importing the class
    (None where it is not a plain value: a factory, a name)."""
    module, qualname = _ref(config).split(":")
    tree, _ = _module_source(module)
    body: Sequence[ast.stmt] = tree.body
    for part in qualname.split("."):
        body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == part), [])
    node = next(
        (
            n.value
            for n in body
            if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name
        ),
        None,
    )
    try:
        value = _constant(node) if node is not None else None
    except ValueError:
        return None
    return None if value is None else str(value)


def _constant(node: ast.expr) -> object:
    """A default written as a constant or arithmetic on constants (``512 << 20``)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple):
        return tuple(_constant(e) for e in node.elts)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_constant(node.left), _constant(node.right))
    raise ValueError(ast.unparse(node))


_OPERATORS: dict[type, Callable[[Any, Any], Any]] = {
    ast.LShift: operator.lshift,
    ast.Mult: operator.mul,
    ast.Add: operator.add,
    ast.Sub: operator.sub,
}


def field_doc(config: type | str, name: str) -> str:
    """The one-line comment of field ``name``: the help of its flag, also where a command parses the
    flag itself (a comma-separated list, say)."""
    doc = _declared_field(config, name)[1]
    if not doc:
        raise ValueError(f"{_ref(config)}.{name} has no one-line # comment to serve as its help")
    return doc


def _declared_field(config: type | str, name: str) -> tuple[ast.expr, str]:
    module, qualname = _ref(config).split(":")
    declared = _declared(module, qualname)
    if name not in declared:
        raise ValueError(f"{module}:{qualname} has no field {name!r}")
    return declared[name]


@cache
def _module_source(module: str) -> tuple[ast.Module, dict[int, str]]:
    """A module's syntax tree and its comments by line, read without importing the module."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"no source for module {module}")
    text = Path(spec.origin).read_text(encoding="utf-8")
    comments = {
        tok.start[0]: tok.string.lstrip("#").strip()
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.COMMENT
    }
    return ast.parse(text), comments


@cache
def _declared(module: str, qualname: str) -> dict[str, tuple[ast.expr, str]]:
    """``{field: (annotation, comment on its last line)}`` of a class body in ``module``."""
    tree, comments = _module_source(module)
    body: Sequence[ast.stmt] = tree.body
    for part in qualname.split("."):
        cls = next((n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None)
        if cls is None:
            raise ValueError(f"no class {qualname} in {module}")
        body = cls.body
    return {
        node.target.id: (node.annotation, comments.get(node.end_lineno or node.lineno, ""))
        for node in body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }


def _kind(annotation: ast.expr, module: str) -> tuple[Callable[[str], Any], tuple[str, ...] | None]:
    """(kind, Literal choices) of an annotation in ``module``; TypeError for a type no flag can take."""
    node = annotation
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):  # X | None
        parts = [p for p in (node.left, node.right) if not (isinstance(p, ast.Constant) and p.value is None)]
        if len(parts) == 1:
            return _kind(parts[0], module)
    if isinstance(node, ast.Name):
        if node.id == "bool":
            return bool, None
        if node.id in _SCALARS:
            return _SCALARS[node.id], None
        if node.id == "ByteSize":  # an int whose flag also takes units
            from epdserve.common.units import parse_bytes

            return parse_bytes, None
        return _kind(*_alias(node.id, module))
    if isinstance(node, ast.Subscript):
        generic = ast.unparse(node.value)
        if generic in ("Literal", "typing.Literal"):
            literal = ast.literal_eval(node.slice)
            choices = literal if isinstance(literal, tuple) else (literal,)
            if all(isinstance(c, str) for c in choices):
                return str, choices
        if generic == "tuple" and ast.unparse(node.slice).strip("()") == "str, ...":
            return tuple, None
    raise TypeError(f"no command-line flag for a field of type {ast.unparse(annotation)} ({module})")


def _alias(name: str, module: str) -> tuple[ast.expr, str]:
    """The definition of a type alias ``name`` used in ``module``, and the module that defines it."""
    tree, _ = _module_source(module)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return node.value, module
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _alias(alias.name, node.module)
    raise TypeError(f"no command-line flag for a field of type {name} ({module})")


def usage_error(message: str) -> NoReturn:
    print(f"epdserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)
