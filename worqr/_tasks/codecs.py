"""How a call's arguments and its result are written as a payload: JSON (the
default, readable by any language), MessagePack, or pickle (which runs code named by
the payload, so only a registry that opts in reads it).

A payload is text (a job's payload must be valid UTF-8), so MessagePack's and
pickle's bytes travel in base64."""

from __future__ import annotations

import binascii
import functools
import math
import pickle
from typing import Any, Literal

import msgspec

Format = Literal["json", "msgpack", "pickle"]
FORMATS: tuple[Format, ...] = ("json", "msgpack", "pickle")


class DecodeError(ValueError):
    """A payload or result that does not decode to the type asked for."""


class Codec:
    """One format's encoder, and a decoder per type (made once, then reused)."""

    name: Format = "json"

    def __init__(self) -> None:
        self._encode = msgspec.json.Encoder().encode
        self._sorted = msgspec.json.Encoder(order="deterministic").encode

    def encode(self, value: object, *, deterministic: bool = False) -> str:
        """``value`` as a payload (``deterministic``: dicts and sets sorted). A value
        the format cannot hold raises `TypeError`, `ValueError` (a NaN or an infinity,
        which JSON has no number for), `OverflowError` or `RecursionError`."""
        data = (self._sorted if deterministic else self._encode)(value)
        if b"null" in data and _non_finite(msgspec.to_builtins(value)):  # written as null
            raise ValueError("JSON has no NaN or infinity (msgpack carries them)")
        return data.decode("utf-8")

    def decode(self, raw: str, kind: Any) -> Any:
        """``raw`` as a value of ``kind``, checked; `DecodeError` otherwise."""
        try:
            return _json_decoder(kind).decode(raw)
        except (msgspec.DecodeError, RecursionError) as exc:  # ValidationError included
            raise DecodeError(str(exc) or "nested too deeply") from None

    def check(self, kind: Any) -> None:
        """Raise `TypeError` if values of ``kind`` cannot be decoded."""
        _json_decoder(kind)
        _no_custom_type(msgspec.inspect.type_info(kind))


class MsgPack(Codec):
    name: Format = "msgpack"

    def __init__(self) -> None:
        self._encode = msgspec.msgpack.Encoder().encode
        self._sorted = msgspec.msgpack.Encoder(order="deterministic").encode

    def encode(self, value: object, *, deterministic: bool = False) -> str:
        return _text((self._sorted if deterministic else self._encode)(value))

    def decode(self, raw: str, kind: Any) -> Any:
        try:
            return _msgpack_decoder(kind).decode(_bytes(raw))
        except (msgspec.DecodeError, RecursionError) as exc:
            raise DecodeError(str(exc) or "nested too deeply") from None

    def check(self, kind: Any) -> None:
        _msgpack_decoder(kind)
        _no_custom_type(msgspec.inspect.type_info(kind))


class Pickle(Codec):
    """Any picklable value, unchecked: decoding runs what the payload names."""

    name: Format = "pickle"

    def __init__(self) -> None:
        pass

    def encode(self, value: object, *, deterministic: bool = False) -> str:
        try:
            data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, AttributeError) as exc:
            raise TypeError(f"cannot pickle: {exc}") from None
        return _text(data)

    def decode(self, raw: str, kind: Any) -> Any:
        try:
            return pickle.loads(_bytes(raw))  # the registry opted in
        except Exception as exc:
            raise DecodeError(f"cannot unpickle: {type(exc).__name__}: {exc}") from None

    def check(self, kind: Any) -> None:
        pass


CODECS: dict[str, Codec] = {codec.name: codec for codec in (Codec(), MsgPack(), Pickle())}


def codec(name: object) -> Codec:
    """The codec called ``name``; `ValueError` (or `TypeError`) for another."""
    if not isinstance(name, str):
        raise TypeError(f"serializer must be a str, not {type(name).__name__}")
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"serializer must be one of {', '.join(FORMATS)}, not {name!r}") from None


def _non_finite(value: object) -> bool:
    """Whether ``value`` (plain containers of builtins) holds a NaN or an infinity."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_non_finite(item) for item in value)
    return False


def _text(data: bytes) -> str:
    return binascii.b2a_base64(data, newline=False).decode("ascii")


def _bytes(raw: str) -> bytes:
    try:
        return binascii.a2b_base64(raw)
    except (binascii.Error, ValueError) as exc:
        raise DecodeError(f"not base64: {exc}") from None


def _no_custom_type(info: msgspec.inspect.Type) -> None:
    """`TypeError` if ``info`` holds a class msgspec would need a hook for."""
    if isinstance(info, msgspec.inspect.CustomType) and info.cls is not object:
        raise TypeError(f"{info.cls.__qualname__} is not a type it carries")
    for name in info.__struct_fields__:
        value = getattr(info, name)
        inner = value if isinstance(value, tuple) else (value,)
        for item in inner:
            if isinstance(item, msgspec.inspect.Field):
                item = item.type
            if isinstance(item, msgspec.inspect.Type):
                _no_custom_type(item)


@functools.lru_cache(maxsize=4096)
def _json_decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind)


@functools.lru_cache(maxsize=4096)
def _msgpack_decoder(kind: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(kind)
