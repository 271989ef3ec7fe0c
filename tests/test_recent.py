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
    assert "c" in cache  # a membership test is a use too
    cache.put("e")
    assert "a" not in cache and "c" in cache and "e" in cache and cache.get("e") is None


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
