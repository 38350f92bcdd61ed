"""The quick tier (`python -m pytest -m quick`, tests/quick.txt) names tests that exist.

A renamed or removed test would otherwise leave the tier smaller without a word. Every
entry of tests/quick.txt whose module this run collected must name a collected test; run
with the whole suite (or `-m quick`), every entry is checked.
"""

from tests import conftest


def test_every_entry_of_the_quick_tier_names_a_collected_test(request):
    entries = conftest.quick_entries()
    collected = [item.nodeid for item in request.session.items]
    modules = {nodeid.partition("::")[0] for nodeid in collected}
    used = {conftest.is_quick(nodeid, entries) for nodeid in collected}
    stale = [entry for entry in entries
             if entry not in used and entry.partition("::")[0] in modules]
    assert not stale, f"tests/quick.txt names no collected test: {stale}"
    assert len(set(entries)) == len(entries), "tests/quick.txt repeats an entry"
