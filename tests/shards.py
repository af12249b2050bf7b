"""CI's share of the slow tests: ``--drill-shard I/N`` (tests/conftest.py) keeps every test that is
not ``slow``, every ``slow`` one marked ``core``, and shard I of the other ``slow`` ones: sorted by
test id, every N-th from the I-th. The N shards of a selection are disjoint and cover it."""


def parse(spec: str) -> tuple[int, int]:
    """``"I/N"`` -> ``(I, N)`` with ``0 <= I < N``; anything else is a ValueError naming the value."""
    try:
        i, n = (int(x) for x in spec.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise ValueError(f"--drill-shard {spec!r}: give I/N with 0 <= I < N, e.g. 0/3")
    return i, n


def rotating(item) -> bool:
    """A ``slow`` test that is not ``core``: CI runs it in its shard only."""
    marks = {m.name for m in item.iter_markers()}
    return "slow" in marks and "core" not in marks


def split(items: list, spec: str) -> tuple[list, list]:
    """``(kept, dropped)`` of ``items`` (pytest items: ``nodeid``, ``iter_markers``), in their order."""
    i, n = parse(spec)
    rotate = {item.nodeid for item in items if rotating(item)}
    drop = rotate - set(sorted(rotate)[i::n])
    return [x for x in items if x.nodeid not in drop], [x for x in items if x.nodeid in drop]
