"""The bounded caches of prepared launches and passed checks keep the most recently used entries."""

from kvcanary_cupy._recent import GEOMETRIES_KEPT, RecentlyUsed


def test_keeps_the_most_recent_and_drops_the_least():
    cache = RecentlyUsed(3)
    for key in "abc":
        cache.put(key, key.upper())
    assert cache.get("a") == "A"  # a is now the most recent
    cache.put("d", "D")
    assert "b" not in cache and len(cache) == 3
    assert [cache.get(key) for key in "acd"] == ["A", "C", "D"]
    assert cache.values() == ["A", "C", "D"]
    assert "a" in cache  # a membership test is a use too: the least recent becomes the most
    cache.put("e")
    assert cache.values() == ["D", "A", None]
    assert "c" not in cache and "a" in cache and "e" in cache and cache.get("e") is None


def test_putting_a_kept_key_again_makes_it_the_most_recent():
    cache = RecentlyUsed(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.put("a", 3) == 3
    cache.put("c", 4)
    assert "b" not in cache and cache.values() == [3, 4]


def test_pop_says_whether_the_key_was_there_and_stored_none_counts():
    cache = RecentlyUsed()
    cache.put("key")
    assert cache.get("missing", "default") == "default"
    assert cache.pop("key") and not cache.pop("key")
    for key in range(GEOMETRIES_KEPT + 5):
        cache.put(key)
    assert len(cache) == GEOMETRIES_KEPT and 4 not in cache and 5 in cache
    cache.clear()
    assert len(cache) == 0
