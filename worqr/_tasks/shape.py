"""What a task function takes and returns, read once from its signature: whether its
first parameter is the `Context`, the parameters a call carries (each with the type
its value is checked against when the call is decoded), and the result's type."""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Union

import msgspec

from .codecs import Codec, DecodeError
from .context import Context

_P = inspect.Parameter


@dataclass(frozen=True, slots=True)
class Shape:
    """A task function's parameters as a call carries them."""

    signature: inspect.Signature
    """The function's signature without the Context."""
    takes_context: bool
    arguments: type[msgspec.Struct]
    """One field per parameter: its type, and UNSET when the call leaves it out (the
    function's own default then applies, evaluated where it runs)."""
    result: Any
    """The declared return type (Any when not declared)."""
    by_name: bool
    """Every parameter may be passed by name: a call is ``function(**values)``."""

    def encode_call(
        self,
        codec: Codec,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        *,
        deterministic: bool = False,
    ) -> str:
        """The payload of a call: each given argument by its parameter's name
        (``deterministic``: dicts and sets sorted, so that the same call is always the
        same text). `TypeError` when they do not fit the signature or cannot be
        encoded."""
        bound = self.signature.bind(*args, **kwargs)
        return codec.encode(bound.arguments, deterministic=deterministic)

    def decode_call(self, codec: Codec, payload: str) -> tuple[list[Any], dict[str, Any]]:
        """The positional and keyword arguments of a call, each checked against its
        type; `DecodeError` for a payload that does not fit."""
        decoded = codec.decode(payload, self.arguments)
        if isinstance(decoded, self.arguments):
            values = {
                name: value
                for name in self.arguments.__struct_fields__
                if (value := getattr(decoded, name)) is not msgspec.UNSET
            }
        elif isinstance(decoded, dict):  # pickle: unchecked but by name
            values = decoded
            unknown = set(values) - set(self.signature.parameters)
            if unknown:
                raise DecodeError(f"unknown argument {sorted(map(str, unknown))[0]!r}")
        else:
            raise DecodeError(f"a call's arguments are a mapping, not {type(decoded).__name__}")
        if self.by_name:
            return [], values
        return _arranged(self.signature, values)


def _arranged(
    signature: inspect.Signature, values: dict[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """``values`` (by parameter name) as positional and keyword arguments. A parameter
    that must go by position because a later one does (positional-only, or before a
    given ``*args``) may not be left out: `DecodeError` rather than a call that shifts
    or drops an argument."""
    parameters = list(signature.parameters.values())
    starred = any(p.kind is _P.VAR_POSITIONAL and values.get(p.name) for p in parameters)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    missing: str | None = None
    for parameter in parameters:
        name, kind = parameter.name, parameter.kind
        positional = kind is _P.POSITIONAL_ONLY or (kind is _P.POSITIONAL_OR_KEYWORD and starred)
        if positional or (kind is _P.VAR_POSITIONAL and values.get(name)):
            if name not in values:
                missing = missing or name
                continue
            if missing is not None:
                raise DecodeError(f"{name!r} is given but {missing!r} before it is not")
            if kind is _P.VAR_POSITIONAL:
                args.extend(values[name])
            else:
                args.append(values[name])
        elif kind is _P.VAR_KEYWORD:
            extra = values.get(name) or {}
            clash = sorted(set(extra) & set(signature.parameters))
            if clash:
                raise DecodeError(f"{clash[0]!r} is given twice")
            kwargs.update(extra)
        elif kind is not _P.VAR_POSITIONAL and name in values:
            kwargs[name] = values[name]
    return args, kwargs


def shape_of(function: Callable[..., Any], name: str, codec: Codec) -> Shape:
    """The shape of ``function``; `TypeError` naming the parameter whose type the
    registry's format cannot carry."""
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(_annotated(function), include_extras=True)
    except Exception as exc:  # a name the annotations use is not defined
        raise TypeError(f"task {name}: cannot resolve its annotations: {exc}") from None
    parameters = list(signature.parameters.values())
    takes_context = bool(parameters) and _is_context(hints.get(parameters[0].name))
    if takes_context:
        if parameters[0].kind not in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD):
            raise TypeError(f"task {name}: its Context must be its first positional parameter")
        parameters = parameters[1:]
    for parameter in parameters:
        if _is_context(hints.get(parameter.name)):
            raise TypeError(f"task {name}: only its first parameter may be the Context")
    fields: list[tuple[str, Any, Any]] = []
    for parameter in parameters:
        kind: Any = hints.get(parameter.name, Any)
        if parameter.kind is _P.VAR_POSITIONAL:
            kind = tuple[kind, ...]
        elif parameter.kind is _P.VAR_KEYWORD:
            kind = dict[str, kind]
        optional = parameter.default is not _P.empty or parameter.kind in (
            _P.VAR_POSITIONAL,
            _P.VAR_KEYWORD,
        )
        if optional:
            fields.append((parameter.name, Union[kind, msgspec.UnsetType], msgspec.UNSET))  # noqa: UP007 - kind may be Any
        else:
            fields.append((parameter.name, kind, msgspec.NODEFAULT))
    arguments = msgspec.defstruct(
        f"{name}.arguments",
        [field if field[2] is not msgspec.NODEFAULT else field[:2] for field in fields],
        kw_only=True,
        forbid_unknown_fields=True,
    )
    result = hints.get("return", Any)  # of a coroutine function: what it returns
    for what, kind in [("arguments", arguments), ("result", result)]:
        try:
            codec.check(kind)
        except TypeError as exc:
            raise TypeError(f"task {name}: its {what} cannot be {codec.name}: {exc}") from None
    return Shape(
        signature=signature.replace(parameters=parameters),
        takes_context=takes_context,
        arguments=arguments,
        result=result,
        by_name=all(p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY) for p in parameters),
    )


def _annotated(function: Callable[..., Any]) -> Callable[..., Any]:
    """What holds ``function``'s annotations: itself, a partial's function, or an
    object's ``__call__``."""
    if isinstance(function, functools.partial):
        return _annotated(function.func)
    if inspect.isroutine(function) or inspect.isclass(function):
        return function
    call: Callable[..., Any] = type(function).__call__
    return call


def _is_context(annotation: object) -> bool:
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return isinstance(annotation, type) and issubclass(annotation, Context)
