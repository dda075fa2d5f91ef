"""Lock stand-ins for the tests of SafeSage's shared caches (tests/unit/test_report_store.py,
test_cache_locks.py).

A :class:`CountingLock` replaces a module's or object's lock; :func:`guard` replaces a container
it protects by one that records, for every mutation, whether that lock was held by the mutating
thread. A function that changes the container without taking the lock shows up in
``Ledger.unlocked`` -- deterministically, whatever the GIL does (a race test can pass by luck;
this cannot)."""
import threading
from collections import Counter


class CountingLock:
    """Stand-in for a ``threading.Lock``: counts acquisitions and knows which thread holds it."""

    def __init__(self):
        self._lock = threading.Lock()
        self.acquisitions = 0
        self.owner = None

    def acquire(self, blocking=True, timeout=-1):
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self.acquisitions += 1
            self.owner = threading.get_ident()
        return ok

    def release(self):
        self.owner = None
        self._lock.release()

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()
        return False

    def held(self) -> bool:
        return self.owner == threading.get_ident()


class Ledger:
    """Every mutation of the guarded containers: (container, operation, lock held)."""

    def __init__(self):
        self.events = []

    @property
    def unlocked(self):
        return [e for e in self.events if not e[2]]


_MUTATORS = ("__setitem__", "__delitem__", "pop", "popitem", "clear", "update", "setdefault")


def _guarded_class(base):
    def make(name):
        real = getattr(base, name)

        def mutator(self, *a, **k):
            if "_ledger" not in self.__dict__:       # still being built
                return real(self, *a, **k)
            self._ledger.events.append((self._label, name, self._lock.held()))
            if name == "setdefault" and len(a) > 1 and isinstance(a[1], (dict, Counter)):
                a = (a[0], guard(a[1], self._lock, self._ledger, f"{self._label}[{a[0]!r}]"))
            return real(self, *a, **k)
        return mutator
    return type(f"Guarded{base.__name__}", (base,), {n: make(n) for n in _MUTATORS})


_CLASSES = {dict: _guarded_class(dict), Counter: _guarded_class(Counter)}


def guard(container, lock, ledger: Ledger, label: str):
    """A copy of ``container`` (dict or Counter, inner dicts / Counters too) that records each
    mutation in ``ledger`` with whether ``lock`` was held."""
    cls = _CLASSES[Counter if isinstance(container, Counter) else dict]
    g = cls()
    for k, v in container.items():
        dict.__setitem__(g, k, guard(v, lock, ledger, f"{label}[{k!r}]") if type(v) in (dict, Counter) else v)
    g._lock, g._ledger, g._label = lock, ledger, label
    return g
