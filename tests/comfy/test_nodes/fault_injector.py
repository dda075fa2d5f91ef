"""Test-only fault injection into the SafeSage pack, inside the ComfyUI server process.

The node SafeSageTestFaults (MODEL -> MODEL, put between the loader and SafeSageAttention so that
SafeSage patches the model afresh in every prompt) adds an OUTER_SAMPLE wrapper, first in order so
that it is the outermost one: the whole sampling run -- everything SafeSage's code does after the
node patched the model -- happens inside it, in this thread. In it:

  mode "record": ``sys.setprofile`` records every Python function whose code lives in the pack's
      safe_ops/ or nodes/ and is called during sampling, with its call count; the boundary's own
      code is listed apart (contain.py, report.py -- the stats code -- and functions that
      contain.boundary marked, with everything nested in them).
  mode "inject": the function named by ``target`` (as recorded) is made to raise RuntimeError:
      its code object is swapped, in every live function object that has it and, for a nested
      function (a lambda, a closure made per call), in the code of the functions it is made in,
      so that every reference to it raises -- however it was imported. ``only_call`` > 0 raises
      on that call only (the others run the original). Everything is restored when sampling ends.
      A target "comfy:<module>:<attribute path>" is one of ComfyUI's own functions instead; a
      target "<file>:<qualified name>" (no line, no column: written by hand) is the one function of
      the pack of that name.
  mode "inject_node": the same injection, entered when this node runs (before SafeSageAttention,
      which takes this node's model) and restored when sampling starts: the fault is in SafeSage's
      node's execute (patching the model), not in the sampling run. A prompt that failed before
      sampling has its injection restored by the next run of this node. Its report holds the
      target's "calls" and "hits" at that point.
  mode "none": nothing (the same graph shape without a fault).
In the other modes the wrapper first runs ``gc.collect()``: what earlier prompts left unreachable (their
SafeSage node's quality guard, held in a WeakSet until collected) is gone before the run, so that a
function called once per live object is called as often in a recording as in an injected prompt.

The raise happens in a frame whose code carries the target's file name and qualified name, as
if that function's own code raised. After sampling the wrapper writes what it saw to
<output>/safesage_test/faults_<tag>.json: the recorded functions, or the calls of the target and
how many of them raised ("hits"), so that a test can tell an injection that was never reached;
and the seconds the collection, the injection's setup and the run took ("gc_s", "setup_s", "run_s").

tests/unit/test_node_contained.py loads this file outside a server (``ROOT`` set to the checkout)
and uses its Recorder and Injection around the node's own run (``safe_ops.patch.apply_node``).
"""

from __future__ import annotations

import gc
import importlib
import inspect
import json
import os
import sys
import threading
import time
import types

ALIAS = "safesage_fault_injector"           # the raising code finds this module under this name
PACK_DIR_NAME = "ComfyUI-SafeSage"
SUBDIRS = ("safe_ops", "nodes")
BOUNDARY_FILES = ("safe_ops/contain.py", "safe_ops/ui/run_stats.py")
WRAPPER_KEY = "safesage_fault_test"

_lock = threading.Lock()
_faults: dict = {}        # target key -> {"calls", "hits", "only_call", "orig": code, "globals", ...}


# ----------------------------------------------------------------------------- the pack's code
#: the pack's folder where this module runs outside a ComfyUI server (tests/unit sets it: the checkout)
ROOT = None


def pack_root() -> str:
    if ROOT is not None:
        return ROOT
    import folder_paths
    return os.path.realpath(os.path.join(folder_paths.get_folder_paths("custom_nodes")[0], PACK_DIR_NAME))


_rel_cache: dict = {}


def pack_rel(filename: str):
    """'safe_ops/x.py' for a file of the pack's safe_ops/ or nodes/, else None."""
    try:
        return _rel_cache[filename]
    except KeyError:
        pass
    root = pack_root()
    path = os.path.realpath(filename)
    rel = None
    if path.startswith(root + os.sep):
        r = os.path.relpath(path, root).replace(os.sep, "/")
        if r.split("/")[0] in SUBDIRS:
            rel = r
    _rel_cache[filename] = rel
    return rel


def code_key(code) -> str:
    """file:qualified name:line:column -- the column tells apart two generator expressions or
    lambdas on one line."""
    col = next((c for _, _, c, _ in code.co_positions() if c), 0)
    return "%s:%s:%d:%d" % (pack_rel(code.co_filename), code.co_qualname, code.co_firstlineno, col)


_GENERATOR_FLAGS = 0x20 | 0x80 | 0x200      # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR


def _pack_functions():
    """Every live function object whose code is the pack's (module functions, methods, closures)."""
    return [o for o in gc.get_objects() if _is_pack_function(o)]


def _is_pack_function(o) -> bool:
    try:
        return isinstance(o, types.FunctionType) and pack_rel(o.__code__.co_filename) is not None
    except ReferenceError:      # a dead weakref.proxy among gc's objects (torch.compile leaves some)
        return False


def _children(code):
    return [c for c in code.co_consts if isinstance(c, types.CodeType)]


def _index(funcs):
    """(parent of each code, the codes of boundary functions and everything nested in them)."""
    parent, boundary = {}, set()

    def walk(code, in_boundary):
        if in_boundary:
            boundary.add(code)
        for c in _children(code):
            parent[c] = code
            walk(c, in_boundary)

    for f in funcs:
        walk(f.__code__, bool(getattr(f, "_safesage_boundary", False)))
    return parent, boundary


def is_boundary(code, boundary) -> bool:
    return code in boundary or pack_rel(code.co_filename) in BOUNDARY_FILES


# ----------------------------------------------------------------------------- recording
class Recorder:
    """The profile function: calls per code object of the pack. A generator's frame gets a "call"
    event at every resumption: its calls are its distinct frames (held until the run ends)."""

    def __init__(self):
        self.calls: dict = {}
        self._frames: dict = {}       # generator code -> {id(frame): frame}

    def __call__(self, frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        n = self.calls.get(code)
        if n is None:
            if pack_rel(code.co_filename) is None:
                return
            n = 0
        if code.co_flags & _GENERATOR_FLAGS:
            frames = self._frames.setdefault(code, {})
            if id(frame) in frames:
                return
            frames[id(frame)] = frame
        self.calls[code] = n + 1

    def result(self) -> dict:
        _, boundary = _index(_pack_functions())
        out = {"functions": [], "boundary": []}
        for code, n in sorted(self.calls.items(), key=lambda kv: code_key(kv[0])):
            if code.co_name == "<module>":
                continue
            entry = {"key": code_key(code), "calls": n, "freevars": len(code.co_freevars)}
            out["boundary" if is_boundary(code, boundary) else "functions"].append(entry)
        return out


# ----------------------------------------------------------------------------- injection
def fault(key, args, kwargs, cells):
    """Called by the raising code: (exception to raise, None) or (None, the original's result)."""
    with _lock:
        st = _faults[key]
        st["calls"] += 1
        raise_now = st["only_call"] <= 0 or st["calls"] == st["only_call"]
        if raise_now:
            st["hits"] += 1
    if raise_now:
        return RuntimeError("SafeSage test fault injected in %s (call %d)" % (key, st["calls"])), None
    orig = types.FunctionType(st["orig"], st["globals"], st["orig"].co_name, st["defaults"],
                              tuple(types.CellType(v) for v in cells) if cells else None)
    orig.__kwdefaults__ = st["kwdefaults"]
    return None, orig(*args, **kwargs)


def _raising_code(code, key):
    """A code object with ``code``'s free variables, file and names, whose body asks fault()."""
    fv = code.co_freevars
    lines = ["def _outer():"]
    lines += ["    %s = None" % v for v in fv]
    lines += ["    def _f(*args, **kwargs):",
              "        _e, _v = __import__(%r).fault(%r, args, kwargs, (%s))" % (
                  ALIAS, key, "".join(v + ", " for v in fv)),
              "        if _e is not None:",
              "            raise _e",
              "        return _v",
              "    return _f"]
    ns: dict = {}
    exec(compile("\n".join(lines), code.co_filename, "exec"), ns)
    new = ns["_outer"]().__code__
    assert new.co_freevars == fv, (new.co_freevars, fv)
    return new.replace(co_name=code.co_name, co_qualname=code.co_qualname, co_firstlineno=code.co_firstlineno)


class Injection:
    def __init__(self, key: str, only_call: int = 0):
        self.key = key
        self.only_call = only_call
        self.swapped: list = []          # (function, its original code), in swap order

    def __enter__(self):
        if self.key.startswith("comfy:"):
            # ComfyUI's own function ("comfy:<module>:<attribute path>", unwrapped): its errors
            # must pass through SafeSage untouched
            _, mod, attr = self.key.split(":", 2)
            obj = importlib.import_module(mod)
            for a in attr.split("."):
                obj = getattr(obj, a)
            obj = inspect.unwrap(obj)
            funcs, parent, target = [obj], {}, obj.__code__
        else:
            funcs = _pack_functions()
            parent, _ = _index(funcs)
            codes = {c for c in list(parent) + [f.__code__ for f in funcs]}
            parts = self.key.split(":")
            if len(parts) == 2:     # "<file>:<qualified name>", written by hand: one function of that name
                target = [c for c in codes if c.co_qualname == parts[1] and pack_rel(c.co_filename) == parts[0]]
            else:                   # as recorded; the qualified name and first line first: code_key
                qualname, line = parts[1:3]     # reads every code's positions
                target = [c for c in codes if c.co_qualname == qualname and c.co_firstlineno == int(line)
                          and code_key(c) == self.key]
            if len(target) != 1:
                raise RuntimeError("fault target %s: %d code objects match" % (self.key, len(target)))
            target = target[0]
        owner = next((f for f in funcs if f.__code__ is target), None)
        _faults[self.key] = {"calls": 0, "hits": 0, "only_call": self.only_call, "orig": target,
                             "globals": owner.__globals__ if owner is not None else
                             self._globals_of(target, parent, funcs),
                             "defaults": getattr(owner, "__defaults__", None),
                             "kwdefaults": getattr(owner, "__kwdefaults__", None)}
        new = _raising_code(target, self.key)
        by_code: dict = {}
        for f in funcs:
            by_code.setdefault(f.__code__, []).append(f)
        # the function itself, wherever it lives, then the codes it is made in (new closures raise)
        old = target
        while True:
            for f in by_code.get(old, []):
                self.swapped.append((f, f.__code__))
                f.__code__ = new
            up = parent.get(old)
            if up is None:
                break
            # equal, not identical: a reloaded module's functions have codes equal to the old ones'
            # (the dicts here are keyed by equality, so ``up`` may be the other copy's parent)
            new = up.replace(co_consts=tuple(new if c == old else c for c in up.co_consts))
            old = up
        return self

    @staticmethod
    def _globals_of(code, parent, funcs):
        top = code
        while top in parent:
            top = parent[top]
        for f in funcs:
            if f.__code__ is top:
                return f.__globals__
        raise RuntimeError("no live function holds %s" % code_key(code))

    def __exit__(self, *exc):
        for f, code in reversed(self.swapped):
            f.__code__ = code
        self.swapped.clear()
        return False

    def counts(self) -> dict:
        st = _faults.get(self.key, {})
        return {"calls": st.get("calls", 0), "hits": st.get("hits", 0)}


# ----------------------------------------------------------------------------- the node
def _write(tag: str, data: dict) -> None:
    import folder_paths
    out_dir = os.path.join(folder_paths.get_output_directory(), "safesage_test")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "faults_%s.json" % os.path.basename(tag)), "w") as f:
        json.dump(data, f, indent=1)


def _make_wrapper(mode: str, target: str, only_call: int, tag: str):
    def wrapper(executor, *args, **kwargs):
        data = {"mode": mode, "target": target, "only_call": only_call}
        # dead objects of earlier prompts go first: functions called once per live object (e.g.
        # QualityGuard.run_end, once per guard in quality/guard.py's WeakSet) then run as often in
        # the recording as in every injected prompt, whenever the collector last ran
        t = time.perf_counter()
        gc.collect()
        data["gc_s"] = round(time.perf_counter() - t, 3)
        if mode == "record":
            rec = Recorder()
            old = sys.getprofile()
            sys.setprofile(rec)
            try:
                return executor(*args, **kwargs)
            finally:
                sys.setprofile(old)
                data.update(rec.result())
                rec._frames.clear()
                _write(tag, data)
        if mode == "inject":
            inj = Injection(target, only_call)
            t0 = time.perf_counter()
            try:
                with inj:
                    data["setup_s"] = round(time.perf_counter() - t0, 3)
                    return executor(*args, **kwargs)
            finally:
                data.update(inj.counts())
                data["run_s"] = round(time.perf_counter() - t0, 3)
                _write(tag, data)
        try:
            return executor(*args, **kwargs)
        finally:
            _write(tag, data)
    return wrapper


_at_node: dict = {}      # tag -> Injection entered by the test node, for the SafeSage node's execute


def _end_at_node(tag: str, data: dict) -> None:
    """Restore what mode "inject_node" swapped for prompt ``tag``, and note its counts in ``data``."""
    inj = _at_node.pop(tag, None)
    if inj is not None:
        inj.__exit__(None, None, None)
        data.update(inj.counts())


def _node_wrapper(tag: str, target: str, only_call: int):
    def wrapper(executor, *args, **kwargs):
        data = {"mode": "inject_node", "target": target, "only_call": only_call}
        _end_at_node(tag, data)
        _write(tag, data)
        return executor(*args, **kwargs)
    return wrapper


class SafeSageTestFaults:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",),
                             "mode": (["none", "record", "inject", "inject_node"],),
                             "target": ("STRING", {"default": ""}),
                             "only_call": ("INT", {"default": 0, "min": 0, "max": 1 << 20}),
                             "tag": ("STRING", {"default": "faults"})}}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "_for_testing/safesage"

    def patch(self, model, mode, target, only_call, tag):
        import comfy.patcher_extension as pe
        for left in list(_at_node):       # an earlier prompt that failed before sampling
            _end_at_node(left, {})
        m = model.clone()
        wtype = pe.WrappersMP.OUTER_SAMPLE
        m.remove_wrappers_with_key(wtype, WRAPPER_KEY)
        if mode == "inject_node":
            m.add_wrapper_with_key(wtype, WRAPPER_KEY, _node_wrapper(tag, target, int(only_call)))
            _at_node[tag] = Injection(target, int(only_call)).__enter__()
        else:
            m.add_wrapper_with_key(wtype, WRAPPER_KEY, _make_wrapper(mode, target, int(only_call), tag))
        # first in order: the outermost wrapper (SafeSage's, added later by its node, runs inside it)
        wrappers = m.wrappers[wtype]
        rest = {k: v for k, v in wrappers.items() if k != WRAPPER_KEY}
        mine = wrappers[WRAPPER_KEY]
        wrappers.clear()
        wrappers[WRAPPER_KEY] = mine
        wrappers.update(rest)
        return (m,)


sys.modules.setdefault(ALIAS, sys.modules[__name__])
