"""Task frames become engine calls with arguments decoded into the declared types."""

from __future__ import annotations

import msgspec
import pytest

from stageb_pool.pool.calls import BadRequest, Calls


class Point(msgspec.Struct, frozen=True):
    x: int
    y: int


class Engine:
    def __init__(self):
        self.seen = []

    def typed(self, item: Point, *, scale: dict[str, int], label: str = "") -> int:
        self.seen.append((item, scale, label))
        return (item.x + item.y) * scale["k"]

    def untyped(self, item, *, extra=None):
        self.seen.append((item, extra))
        return item

    def shares(self, item: int, *, p: Point):
        return p


def enc(value) -> bytes:
    return msgspec.json.encode(value)


def test_item_and_shared_values_arrive_as_the_declared_types():
    engine = Engine()
    calls = Calls(engine)
    calls.add_shared("s1", enc({"k": 3}))
    assert calls.call("typed", enc({"x": 1, "y": 2}), {"scale": "s1"}) == 9
    assert engine.seen == [(Point(1, 2), {"k": 3}, "")]


def test_unannotated_parameters_get_plain_json_values():
    engine = Engine()
    calls = Calls(engine)
    calls.add_shared("s", enc([1, "a"]))
    assert calls.call("untyped", enc({"x": 1}), {"extra": "s"}) == {"x": 1}
    assert engine.seen == [({"x": 1}, [1, "a"])]


def test_a_value_that_does_not_fit_the_declared_type_names_the_parameter():
    calls = Calls(Engine())
    with pytest.raises(BadRequest, match=r"parameter 'item': Expected `int`, got `str` - at `\$.x`"):
        calls.call("typed", enc({"x": "1", "y": 2}), {})
    calls.add_shared("bad", enc({"k": "three"}))
    with pytest.raises(BadRequest, match=r"parameter 'scale'"):
        calls.call("typed", enc({"x": 1, "y": 2}), {"scale": "bad"})


def test_a_shared_value_is_decoded_once_per_type_and_dropped_with_its_snapshot():
    engine = Engine()
    calls = Calls(engine)
    calls.add_shared("p", enc({"x": 5, "y": 6}))
    first = calls.call("shares", enc(1), {"p": "p"})
    assert first == Point(5, 6) and calls.call("shares", enc(2), {"p": "p"}) is first
    calls.call("untyped", enc(0), {"extra": "p"})
    assert engine.seen[-1] == (0, {"x": 5, "y": 6})  # another declared type: decoded again, as declared
    calls.add_shared("q", enc({"x": 0, "y": 0}), evict=["p"])
    assert "p" not in calls.values and all(key != "p" for key, _ in calls._decoded)
    with pytest.raises(KeyError):
        calls.call("shares", enc(1), {"p": "p"})
