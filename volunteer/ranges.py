"""Sets of rows as sorted, disjoint [start, end) ranges: which rows arrived, were handed out,
were accounted for. Row sets stay small (a few ranges per micro-batch), so lists suffice."""
from __future__ import annotations

from typing import Iterable, Iterator

Range = tuple[int, int]


class RowSet:
    """A set of integers stored as sorted, disjoint, non-adjacent ranges."""

    def __init__(self, ranges: Iterable[Range] = ()):
        self._r: list[Range] = []
        for r in ranges:
            self.add(r)

    def __iter__(self) -> Iterator[Range]:
        return iter(self._r)

    def __len__(self) -> int:
        return sum(b - a for a, b in self._r)

    def __bool__(self) -> bool:
        return bool(self._r)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RowSet) and self._r == other._r

    def __repr__(self) -> str:
        return f"RowSet({self._r})"

    def ranges(self) -> list[list[int]]:
        return [[a, b] for a, b in self._r]

    def add(self, r: Range) -> None:
        a, b = r
        if a >= b:
            return
        out, placed = [], False
        for x, y in self._r:
            if y < a:
                out.append((x, y))
            elif x > b:
                if not placed:
                    out.append((a, b))
                    placed = True
                out.append((x, y))
            else:
                a, b = min(a, x), max(b, y)
        if not placed:
            out.append((a, b))
        self._r = sorted(out)

    def remove(self, r: Range) -> None:
        a, b = r
        out = []
        for x, y in self._r:
            if y <= a or x >= b:
                out.append((x, y))
                continue
            if x < a:
                out.append((x, a))
            if y > b:
                out.append((b, y))
        self._r = out

    def covers(self, r: Range) -> bool:
        return any(x <= r[0] and r[1] <= y for x, y in self._r)

    def intersects(self, r: Range) -> bool:
        return any(x < r[1] and r[0] < y for x, y in self._r)

    def intersection(self, r: Range) -> list[Range]:
        return [(max(x, r[0]), min(y, r[1])) for x, y in self._r if x < r[1] and r[0] < y]

    def first_run(self, limit: int) -> Range | None:
        """The lowest range, cut to at most ``limit`` rows."""
        if not self._r:
            return None
        a, b = self._r[0]
        return a, min(b, a + limit)
