"""The judge: the process that runs a `code_execution` answer's tests and writes the verdict.

    judge(peer, tests) -> (passed per test, why the first failed, how grading ended)

Runs in the sandbox's judge process (`sandbox_harness`), loaded from its source text like `sandbox_wire`.

The answer's code never runs here. The judge gets the answer's top-level names once the answer's own
code has run, and binds them in the tests' namespace:

- plain data by value (`uid = 65534`, `MOD = 10**9 + 7`);
- modules by name, to the judge's own copy, imported on first use (`import math` in the answer gives
  the tests this process's `math`, which the answer cannot have patched); only standard-library
  modules and top-level packages, never a module whose import runs a program (`__main__`, `this`,
  `antigravity`, `idlelib`, `turtledemo`);
- exception classes to local classes with the same name and builtin base (so `except ValueError` and
  `except MyError` catch what the answer raises);
- everything else (functions, classes, instances) to `Remote` handles whose every use is a request to
  the answer's process. Names that shadow a builtin are not bound: the tests' `range`, `len` and
  `sum` stay the judge's.

What crosses back is data: a plain value the judge compares itself, or another handle. A handle
compared with anything that is not a handle (`add(2, 3) == 5` where `add` returns an object whose
`__eq__` says yes) is unequal, as Python does for unrelated types; two handles are compared by the
answer's objects (`P(1) == P(1)`), which is the answer's word about its own types and nothing else.
Arithmetic, `len`, `bool`, iteration, indexing, attributes and calls on a handle are the answer's.

The answer may call back only what the tests hand it: functions, methods and classes the tests
define, plain-data types, a list of pure builtins (`len`, `sorted`, ...), `math` / `operator`
functions and methods of plain values (`"".join`, `results.append`); attributes of the tests' own
objects, never a name with a leading underscore; iterators the tests hand over (a generator, a `map`)
and the tests' own iterable objects, as iterators. Anything else it gets is a handle it can do nothing
with, so it cannot reach this process's builtins, frames or descriptors through a callback.

The verdict: a test passes when its code ran to its end here with no exception (an assert that
failed inside a callback the answer caught fails it too) and the answer's process answered every
request; the answer's process ending early, or breaking the protocol, ends grading (0.0).
"""

import builtins
import sys
import types

SAFE_BUILTINS = {"abs", "all", "any", "ascii", "bin", "callable", "chr", "divmod", "format", "hash", "hex",
                 "isinstance", "issubclass", "len", "max", "min", "oct", "ord", "pow", "repr", "round", "sorted",
                 "sum", "bool", "int", "float", "complex", "str", "bytes", "list", "tuple", "dict", "set",
                 "frozenset"}
PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset)
PURE_MODULES = ("math", "cmath", "operator")
NO_IMPORT = {"this", "antigravity", "idlelib", "turtledemo"}


class Remote:
    """A handle on an object of the answer's process; each use is a request there."""

    __slots__ = ("_h", "_peer")

    def __init__(self, h):
        object.__setattr__(self, "_h", h)

    def __getattr__(self, name):
        return rpc(self, ["getattr", self._h, str(name)])

    def __setattr__(self, name, value):
        rpc(self, ["setattr", self._h, str(name), enc(self, value)])

    def __delattr__(self, name):
        rpc(self, ["delattr", self._h, str(name)])

    def __call__(self, *args, **kwargs):
        peer = self._peer
        encode = peer.encode
        reply = peer.request(["call", self._h, [encode(a) for a in args],
                              [[str(k), encode(v)] for k, v in kwargs.items()] if kwargs else []])
        if reply[2]:
            changed(peer, reply[2], args, kwargs)
        return peer.decode(reply[1])

    def __eq__(self, other):
        return op(self, "eq", other) if type(other) is Remote else NotImplemented

    def __ne__(self, other):
        return op(self, "ne", other) if type(other) is Remote else NotImplemented

    def __hash__(self):
        return typed(op(self, "hash"), int, "__hash__")

    def __bool__(self):
        return typed(op(self, "bool"), bool, "__bool__")

    def __len__(self):
        return typed(op(self, "len"), int, "__len__")

    def __index__(self):
        return typed(op(self, "index"), int, "__index__")

    def __int__(self):
        return typed(op(self, "int"), int, "__int__")

    def __float__(self):
        return typed(op(self, "float"), float, "__float__")

    def __repr__(self):
        return typed(op(self, "repr"), str, "__repr__")

    def __str__(self):
        return typed(op(self, "str"), str, "__str__")

    def __format__(self, spec):
        return typed(op(self, "format", str(spec)), str, "__format__")

    def __iter__(self):
        it = op(self, "iter")
        return it if type(it) is Remote else iter(it)

    def __next__(self):
        return op(self, "next")

    def __contains__(self, item):
        return bool(op(self, "contains", item))

    def __getitem__(self, key):
        return op(self, "getitem", key)

    def __setitem__(self, key, value):
        op(self, "setitem", key, value)

    def __delitem__(self, key):
        op(self, "delitem", key)

    def __instancecheck__(self, x):
        return type(x) is Remote and typed(op(self, "instancecheck", x), bool, "isinstance")

    def __subclasscheck__(self, c):
        return type(c) is Remote and typed(op(self, "subclasscheck", c), bool, "issubclass")


def _operator(name):
    def forward(self, *args):
        return op(self, name, *args)
    forward.__name__ = "__%s__" % name
    return forward


def _compare(name):
    def forward(self, other):
        return op(self, name, other) if type(other) is Remote else NotImplemented
    forward.__name__ = "__%s__" % name
    return forward


for _name in ("lt", "le", "gt", "ge"):
    setattr(Remote, "__%s__" % _name, _compare(_name))
for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift", "rshift", "and", "or",
              "xor", "radd", "rsub", "rmul", "rtruediv", "rfloordiv", "rmod", "rpow", "rmatmul", "rlshift",
              "rrshift", "rand", "ror", "rxor", "neg", "pos", "abs", "invert", "divmod", "rdivmod", "round"):
    setattr(Remote, "__%s__" % _name, _operator(_name))


def enc(remote, value):
    return remote._peer.encode(value)


def op(remote, name, *args):
    peer = remote._peer
    return rpc(remote, ["op", name, [peer.encode(remote)] + [peer.encode(a) for a in args]])


def typed(value, kind, what):
    if type(value) is not kind:
        raise TypeError("the answer's %s returned %s, not %s" % (what, type(value).__name__, kind.__name__))
    return value


def rpc(remote, msg):
    peer = remote._peer
    return peer.decode(peer.request(msg)[1])


def changed(peer, changes, args, kwargs):
    for change in changes:  # a list, dict or set argument the answer changed in place: changed here too
        if type(change) is not list or len(change) != 2:
            raise peer.refuse("a malformed change of an argument")
        where, new = change
        target = args[where] if type(where) is int and 0 <= where < len(args) else (
            kwargs.get(where) if type(where) is str and kwargs else None)
        new = peer.decode(new)
        if type(target) is list and type(new) is list:
            target[:] = new
        elif type(target) in (dict, set) and type(new) is type(target):
            target.clear()
            target.update(new)


class LazyModule:
    """The judge's own copy of a module the answer imported, imported on first use."""

    __slots__ = ("_name",)

    def __init__(self, name):
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        import importlib
        return getattr(importlib.import_module(object.__getattribute__(self, "_name")), attr)

    def __repr__(self):
        return "<module %r>" % object.__getattribute__(self, "_name")


def importable(name):
    parts = name.split(".")
    if not all(p.isidentifier() and not p.startswith("_") for p in parts) or parts[0] in NO_IMPORT:
        return False
    return len(parts) == 1 or parts[0] in getattr(sys, "stdlib_module_names", ())


def may_call(obj):
    """Whether the answer may call this object of the tests (see the module's docstring)."""
    if isinstance(obj, types.FunctionType):
        return obj.__code__.co_filename.startswith("<test ")
    if isinstance(obj, types.MethodType):
        return may_call(obj.__func__)
    if isinstance(obj, type):
        return obj in PLAIN_TYPES or test_class(obj)
    if isinstance(obj, types.BuiltinFunctionType):
        owner = obj.__self__
        if owner is builtins:
            return obj.__name__ in SAFE_BUILTINS
        if isinstance(owner, types.ModuleType):
            return owner.__name__ in PURE_MODULES
        return type(owner) in PLAIN_TYPES
    if isinstance(obj, types.MethodDescriptorType):
        return obj.__objclass__ in PLAIN_TYPES
    return False


def test_class(c):
    """A class the tests defined (the harness's own are in its modules, grpokit.rewards.sandbox_*, the answer's
    exception classes in "answer")."""
    return isinstance(c, type) and c.__module__ == "__main__"


def serve_tests(peer, msg):
    """A request of the answer's process on one of the tests' objects it was given."""
    if len(msg) < 2 or type(msg[1]) is not int or msg[1] not in peer.mine:
        raise peer.refuse("a request on nothing the tests gave it")
    obj = peer.mine[msg[1]]
    if msg[0] == "call" and len(msg) == 4 and type(msg[2]) is list and type(msg[3]) is list:
        args = peer.decode(msg[2])
        kwargs = {}
        for pair in msg[3]:
            if type(pair) is not list or len(pair) != 2 or type(pair[0]) is not str:
                raise peer.refuse("a malformed keyword argument")
            kwargs[pair[0]] = peer.decode(pair[1])
        if not may_call(obj):
            raise TypeError("the tests' %s cannot be called from the answer" % type(obj).__name__)
        try:
            return obj(*args, **kwargs), []
        except AssertionError:
            STATE["assert_failed"] = True
            raise
    if msg[0] in ("iter", "next") and len(msg) == 2:  # an iterator the tests hand over (a generator, a map)
        if not (hasattr(type(obj), "__next__") or test_class(type(obj)) and hasattr(type(obj), "__iter__")):
            raise TypeError("the tests' %s cannot be iterated from the answer" % type(obj).__name__)
        return (iter(obj) if msg[0] == "iter" else next(obj)), []
    if msg[0] == "getattr" and len(msg) == 3 and type(msg[2]) is str:
        name = msg[2]
        if name.startswith("_") or not (test_class(type(obj)) or test_class(obj)):
            raise AttributeError("the answer may not read %r of the tests' %s" % (name[:50], type(obj).__name__))
        return getattr(obj, name), []
    raise peer.refuse("a request %r on the tests' objects" % msg[0][:20])


STATE = {"assert_failed": False}


def namespace(peer, entries):
    """The tests' namespace from the answer's top-level names (see the module's docstring)."""
    ns = {"__name__": "__main__", "__builtins__": builtins}
    if type(entries) is not list:
        raise peer.refuse("a malformed list of names")
    for entry in entries:
        if type(entry) is not list or len(entry) != 3 or type(entry[0]) is not str or type(entry[1]) is not str:
            raise peer.refuse("a malformed name")
        name, kind, payload = entry
        if not name.isidentifier() or name in vars(builtins) or name.startswith("__") and name.endswith("__"):
            continue
        if kind == "m":
            if type(payload) is str and importable(payload):
                ns[name] = LazyModule(payload)
        elif kind == "e":
            if type(payload) is not list or len(payload) != 2 or type(payload[0]) is not int:
                raise peer.refuse("a malformed exception class")
            ns[name] = peer.exception(name, payload[1], payload[0])
        elif kind == "v":
            ns[name] = peer.decode(payload)
        else:
            raise peer.refuse("a name of kind %r" % kind[:10])
    return ns


def judge(peer, tests):
    """Run each test here; (passes, why the first failure failed, how grading ended)."""
    first = peer.recv()
    if first[0] == "raised":
        return [], "the answer's code raised", "raised"
    if first[0] != "ready" or len(first) != 2:
        raise peer.refuse("%r where the answer's names were due" % first[0][:20])
    ns = namespace(peer, first[1])
    passed, why = [], None
    for i, test in enumerate(tests):
        STATE["assert_failed"] = False
        try:
            code = compile(test, "<test %d>" % i, "exec")
            ok = True
            exec(code, ns)
        except BaseException as e:
            ok = False
            why = why or "test %d: %s: %s" % (i, type(e).__name__, str(e)[:200])
        peer.check()  # the answer's process ended, or broke the protocol, during the test
        if ok and STATE["assert_failed"]:
            ok, why = False, why or "test %d: an assert failed in a callback the answer caught" % i
        passed.append(ok)
    return passed, why, "ok"
