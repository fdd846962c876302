"""The constrained scalar types and the section base every config section is declared with:
the app's schema (app/config/schema.py) and the sections the search reads, which live with
their reader (search/settings.py). msgspec checks the constraints while converting and
reports the key path.

Every number has an upper bound too: a value past it is a typo or an attack (a timeout of
1e300 overflows the event loop, a billion bootstrap iterations run for hours), never a plan.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

TOKENS = 1_000_000_000  # prompt budgets: upstream's production configs set 120,000,000 ("no limit")
TICKETS = 100_000_000  # pool and export sizes


def Int(lo: int, hi: int):
    return Annotated[int, Meta(ge=lo, le=hi)]


def Float(lo: float, hi: float, *, open_low: bool = False):
    return Annotated[float, Meta(gt=lo, le=hi)] if open_low else Annotated[float, Meta(ge=lo, le=hi)]


Seed = Int(-(2**63), 2**63 - 1)  # any 64-bit integer
Probability = Float(0, 1)
Temperature = Float(0, 100)
Penalty = Float(0, 100, open_low=True)
TopP = Float(0, 1, open_low=True)
NonEmptyStr = Annotated[str, Meta(min_length=1)]


class Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of every config section: unknown keys are errors, fields are keyword-only, and a
    loaded config is never changed (a changed copy is ``msgspec.structs.replace``)."""
