"""CI's rotation of the slow tests (tests/shards.py, ``--drill-shard``) on stand-in items."""

from types import SimpleNamespace

import pytest
import shards


def _item(nodeid, *marks):
    return SimpleNamespace(nodeid=nodeid, iter_markers=lambda: [SimpleNamespace(name=m) for m in marks])


ITEMS = [_item("t/a.py::fast"), _item("t/a.py::core_drill", "slow", "core"),
         *(_item(f"t/b.py::drill_{k}", "slow") for k in (3, 0, 4, 1, 2)),
         _item("t/c.py::child", "slow", "child_process")]


def test_the_shards_partition_the_rotating_tests_and_keep_the_others():
    rotating = {x.nodeid for x in ITEMS if shards.rotating(x)}
    assert len(rotating) == 6  # the five drills and the child process; not `fast`, not `core_drill`
    seen = []
    for i in range(3):
        kept, dropped = shards.split(ITEMS, f"{i}/3")
        assert {"t/a.py::fast", "t/a.py::core_drill"} <= {x.nodeid for x in kept}
        assert sorted(x.nodeid for x in kept + dropped) == sorted(x.nodeid for x in ITEMS)
        mine = [x.nodeid for x in kept if shards.rotating(x)]
        assert len(mine) == 2
        seen += mine
    assert sorted(seen) == sorted(rotating)  # disjoint and covering
    kept, _ = shards.split(ITEMS, "0/3")
    assert [x.nodeid for x in kept] == [x.nodeid for x in ITEMS if x.nodeid in {y.nodeid for y in kept}]  # order kept


@pytest.mark.parametrize("spec", ["3/3", "-1/2", "1", "a/b", "1/0"])
def test_a_bad_shard_is_refused_with_its_value(spec):
    with pytest.raises(ValueError, match=f"--drill-shard {spec!r}: give I/N"):
        shards.parse(spec)
