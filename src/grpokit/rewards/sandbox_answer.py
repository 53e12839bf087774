"""The answer's process of the sandbox: runs a `code_execution` answer's code, then serves the judge.

    answer(code, fd): never returns (the process exits when the judge is done with it)

Forked by the judge (`sandbox_harness`), it keeps only its end of the socket to the judge, runs the
answer's code, sends its top-level names and then serves the judge's requests on its own objects until
told to end. It never sees a test, an expected value or a verdict: whatever the answer does to its own
interpreter can change only the values it answers with, which the judge compares as plain data.
Loaded from its source text like `sandbox_wire`.
"""

import builtins

from grpokit.rewards.sandbox_wire import Peer


class Callback:
    """In the answer's process: a handle on an object of the tests: calls, attributes and iteration only."""

    __slots__ = ("_h", "_peer")

    def __init__(self, h):
        object.__setattr__(self, "_h", h)

    def __call__(self, *args, **kwargs):
        peer = object.__getattribute__(self, "_peer")
        reply = peer.request(["call", self._h, [peer.encode(a) for a in args],
                              [[str(k), peer.encode(v)] for k, v in kwargs.items()]])
        return peer.decode(reply[1])

    def __getattr__(self, name):
        peer = object.__getattribute__(self, "_peer")
        return peer.decode(peer.request(["getattr", self._h, str(name)])[1])

    def __iter__(self):
        return self._peer.decode(self._peer.request(["iter", self._h])[1])

    def __next__(self):
        return self._peer.decode(self._peer.request(["next", self._h])[1])


class AnswerPeer(Peer):
    def encode_other(self, x, depth):
        to = getattr(type(x), "tolist", None)  # numpy arrays and scalars cross as plain data
        if callable(to):
            try:
                return self.encode(to(x), depth + 1)
            except Exception:
                pass
        return {"h": self.export(x)}


def answer_ops():
    import operator as o
    ops = {"eq": o.eq, "ne": o.ne, "lt": o.lt, "le": o.le, "gt": o.gt, "ge": o.ge, "hash": hash, "bool": bool,
           "len": len, "index": o.index, "int": int, "float": float, "repr": repr, "str": str, "format": format,
           "iter": iter, "next": next, "contains": o.contains, "getitem": o.getitem, "setitem": o.setitem,
           "delitem": o.delitem, "instancecheck": lambda c, x: isinstance(x, c),
           "subclasscheck": lambda c, s: issubclass(s, c), "neg": o.neg, "pos": o.pos, "abs": abs,
           "invert": o.invert, "divmod": divmod, "rdivmod": lambda a, b: divmod(b, a), "round": round}
    for name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul", "lshift", "rshift", "and",
                 "or", "xor"):
        f = getattr(o, name + "_" if name in ("and", "or") else name)
        ops[name] = f
        ops["r" + name] = (lambda f: lambda a, b: f(b, a))(f)
    return ops


def serve_answer(peer, msg, ops=answer_ops()):
    """A request of the judge on one of the answer's objects."""
    kind = msg[0]
    if kind == "op":
        args = peer.decode(msg[2])
        return ops[msg[1]](*args), []
    obj = peer.mine[msg[1]]
    if kind == "getattr":
        return getattr(obj, msg[2]), []
    if kind == "setattr":
        return setattr(obj, msg[2], peer.decode(msg[3])), []
    if kind == "delattr":
        return delattr(obj, msg[2]), []
    args = peer.decode(msg[2])
    kwargs = {k: peer.decode(v) for k, v in msg[3]} if msg[3] else {}
    value = obj(*args, **kwargs)
    changed = []  # the lists, dicts and sets it was given and changed in place
    for where, arg in [*enumerate(args), *kwargs.items()]:
        if type(arg) in (list, dict, set):
            now = peer.encode(arg)
            if now != (msg[2][where] if type(where) is int else dict(msg[3])[where]):
                changed.append([where, now])
    return value, changed


def describe_names(peer, ns):
    import types
    out = []
    for name, value in list(ns.items()):
        if isinstance(value, types.ModuleType):
            out.append([name, "m", str(value.__name__)])
        elif isinstance(value, type) and issubclass(value, BaseException):
            base = next((c for c in value.__mro__ if c.__module__ == "builtins"), BaseException)
            out.append([name, "e", [peer.export(value), base.__name__]])
        else:
            try:
                enc = peer.encode(value)
                if len(peer.dumps(enc)) > 1 << 20:
                    raise ValueError
            except Exception:
                enc = {"h": peer.export(value)}
            out.append([name, "v", enc])
    return out


def answer(code, fd):
    from os import _exit
    peer = AnswerPeer(fd, Callback, serve_answer)
    ns = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(code, "<answer>", "exec"), ns)
    except BaseException as e:
        peer.send(["raised", type(e).__name__])
        _exit(0)
    try:
        peer.send(["ready", describe_names(peer, ns)])
        while True:
            peer.answer(peer.recv())
    except BaseException:
        _exit(0)
