"""How a task becomes a method call on the engine: its item and shared values are decoded
straight into the types the engine method declares (unannotated: plain JSON), so a value
that does not fit fails as that task's error, naming the parameter.
"""

from __future__ import annotations

import inspect
import typing

import msgspec

_ANY = msgspec.json.Decoder()


class BadRequest(TypeError):
    """A task's item or shared value does not fit the declared parameter type."""


class _Signature:
    """The decoders of one engine method: its first parameter and its keyword parameters."""

    def __init__(self, method):
        try:
            hints = typing.get_type_hints(method)
        except Exception:  # an annotation that does not resolve: decode as plain JSON
            hints = {}
        params = [p for p in inspect.signature(method).parameters.values()
                  if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        self.item_name = params[0].name if params else "item"
        self.item = _decoder(hints.get(self.item_name))
        self.shared = {p.name: _decoder(hints.get(p.name)) for p in params[1:]}

    def decode_item(self, raw: bytes):
        return _decode(self.item, raw, self.item_name)

    def decoder_for(self, name: str) -> msgspec.json.Decoder:
        return self.shared.get(name, _ANY)


def _decoder(tp) -> msgspec.json.Decoder:
    return _ANY if tp is None or tp is typing.Any else msgspec.json.Decoder(tp)


def _decode(decoder: msgspec.json.Decoder, raw: bytes, name: str):
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadRequest(f"parameter {name!r}: {exc}") from None


class Calls:
    """Calls engine methods; holds the shared values as bytes, decoded once per type asked."""

    def __init__(self, engine):
        self.engine = engine
        self._signatures: dict[str, _Signature] = {}
        self.values: dict[str, bytes] = {}  # key -> encoded value; the parent decides what stays
        self._decoded: dict[tuple[str, int], object] = {}

    def add_shared(self, key: str, raw: bytes, evict=()) -> None:
        for old in evict:
            self.values.pop(old, None)
        self.values[key] = raw
        self._decoded = {k: v for k, v in self._decoded.items() if k[0] in self.values}

    def call(self, method: str, item: bytes, shared: dict[str, str]):
        bound = getattr(self.engine, method)
        sig = self._signatures.get(method)
        if sig is None:
            sig = self._signatures[method] = _Signature(bound)
        kwargs = {name: self._shared(key, sig.decoder_for(name), name) for name, key in shared.items()}
        return bound(sig.decode_item(item), **kwargs)

    def _shared(self, key: str, decoder: msgspec.json.Decoder, name: str):
        cache_key = (key, id(decoder))  # decoders live as long as their signature: ids are stable
        if cache_key not in self._decoded:
            self._decoded[cache_key] = _decode(decoder, self.values[key], name)
        return self._decoded[cache_key]
