"""Issue 31, first part: what the request path now derives once instead of per request gives
the answers the per-request derivation gave.

- ``DeviceSet.fits`` answers without the list schedule while a device holds no bound work:
  the same answer as the schedule's device (checked against it on random bound work).
- The policy memo key: a list of plain values is keyed by its tuple, and the backends' part
  is derived once per facts tuple; a different tuple (a route's backends or labels changed,
  a new route-and-cell entry) gets its own key, and a reload is a new snapshot with an
  empty memo.
"""

from __future__ import annotations

import random

from gateway.core.dispatch import DeviceSet, DispatchQueue
from gateway.core.memory import GIB, DeviceMemory
from gateway.policy import snapshot as policy_snapshot
from gateway.policy.schema import BackendFacts

PER_TOKEN = 128 * 1024
SMALL = DeviceMemory.from_gib(2.0, 0.25)


def _by_schedule(device_set: DeviceSet, now: float, live_bytes: int) -> bool:
    """``fits`` as it was: the device the full list schedule picks."""
    device = min(device_set.schedule(now), key=lambda d: (d.free_at, d.live_bytes))
    return device.live_bytes + live_bytes <= device_set.live_room_bytes


def test_fits_fast_path_agrees_with_the_list_schedule_on_random_bound_work() -> None:
    rng = random.Random(31)
    for _trial in range(200):
        devices = rng.randint(1, 4)
        device_set = DeviceSet(devices, memory=SMALL)
        device_set.place("full-v18", GIB)
        queue = DispatchQueue("q", devices=devices, slots=devices * 2, max_queued=10, device_set=device_set)
        now = 0.0
        for _step in range(rng.randint(0, devices * 2)):
            now += rng.uniform(0.0, 0.05)
            live = rng.randint(0, 6000) * PER_TOKEN
            queue.request(now, latest_start=now + 1.0, cost_ms=rng.uniform(1, 100), live_bytes=live)
        probe_now = now + rng.uniform(0.0, 0.2)
        for tokens in (0, 1, 2000, 4224, 6144, 6145, 9000):
            live = tokens * PER_TOKEN
            assert device_set.fits(probe_now, live) == (
                live <= 0 or _by_schedule(device_set, probe_now, live)
            )


def test_a_list_of_plain_values_is_keyed_by_its_tuple_and_nested_ones_as_before() -> None:
    frozen = policy_snapshot._frozen
    assert frozen(["eu-restricted", "interactive"]) == ("eu-restricted", "interactive")
    assert frozen([1, 2.5, True]) == (1, 2.5, True)
    assert frozen([["a", "b"], {"k": ["v"]}]) == (("a", "b"), (("k", ("v",)),))
    assert frozen({"b": [1], "a": 2}) == (("a", 2), ("b", (1,)))
    assert frozen("x") == "x"


def test_the_backends_key_is_derived_once_per_facts_tuple_and_anew_for_another() -> None:
    snapshot = object.__new__(policy_snapshot.PolicySnapshot)
    snapshot._backend_keys = {}
    first = (BackendFacts(name="local", model="full-v18", labels={"cell": "eu-restricted"}),)
    key = snapshot._backends_key(first)
    assert key == (("local", "full-v18", (("cell", "eu-restricted"),)),)
    assert snapshot._backends_key(first) is key  # the same tuple: derived once
    moved = (BackendFacts(name="local", model="full-v18", labels={"cell": "us-general"}),)
    assert snapshot._backends_key(moved) == (("local", "full-v18", (("cell", "us-general"),)),)
    equal = (BackendFacts(name="local", model="full-v18", labels={"cell": "eu-restricted"}),)
    assert snapshot._backends_key(equal) == key  # another tuple with the same facts: the same key
