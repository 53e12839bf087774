"""The channel between a `code_execution` answer's process and the judge that runs its tests.

    Peer(fd, proxy_type, serve): one end; Refused, Gone: what ends grading

The tests run in the judge, a process the answer's code never ran in; the answer's process only
serves requests on its own objects ("call `add` with (2, 3)", "attribute `v` of object 7", "`==`
between objects 4 and 5"). Both ends speak the same protocol, over one socket:

- A frame is a 4-byte big-endian length and that many bytes of ASCII JSON; a frame over `CAP`, or
  one that is not a JSON list headed by a string, is refused (`Refused`): only the answer's side
  writes such things, and the judge then scores the answer 0.0.
- Values cross by value when they are plain data (None, bool, int, float, complex, str, bytes, list,
  tuple, dict, set, frozenset, range, Fraction, Decimal, Counter, OrderedDict, deque, a defaultdict
  whose factory is a plain type, naive date / datetime / time and timedelta; exact types only,
  containers to 100 levels), rebuilt from the receiver's own classes, and by handle otherwise:
  `{"h": n}`, the sender's n-th exported object, which the receiver wraps in its proxy type;
  `{"y": n}` sends a receiver's object back to it. So an answer's object with a lying `__eq__`
  reaches the judge as a handle, and the judge compares plain values itself.
- A request is `[op, ...]`; its reply is `["ok", value, mutated]` or `["err", class name, builtin
  base name, text, class handle or None]`. While waiting for a reply either side serves the other's
  nested requests (a test's callback the answer calls, an answer's method the callback calls).

Runs in the sandbox (the judge's and the answer's processes), which load it from its source text, in an
interpreter that may not have grpokit installed (`sandbox.harness_argv`): it imports the standard library
only, and keeps to what old interpreters have.
"""

import builtins
import json
import os
import sys

CAP = 64 << 20  # bytes in one frame, either way
DEPTH = 100  # nesting of a value that crosses by value


class Refused(Exception):
    """The other side sent what the protocol does not allow."""


class Gone(Exception):
    """The other side's process ended, or closed the channel."""


TAGS = {tuple: "t", set: "S", frozenset: "F"}
FACTORY_NAMES = {"int": int, "float": float, "str": str, "list": list, "dict": dict, "set": set, "tuple": tuple}
FACTORIES = {None: None, **{f: name for name, f in FACTORY_NAMES.items()}}  # defaultdict's that cross by value


class Peer:
    """One end of the channel: frames, the codec and the table of this side's exported objects."""

    def __init__(self, fd, proxy_type, serve):
        self.fd, self.proxy_type, self.serve = fd, proxy_type, serve
        self.buf = bytearray()
        self.mine, self.ids, self.theirs, self.classes = {}, {}, {}, {}
        self.dead = self.refused = None  # why, once it happened: every later use raises again
        self.exited = self.reading = False
        self.dumps = json.JSONEncoder(ensure_ascii=True, check_circular=False).encode
        self.loads = json.JSONDecoder().decode

    def gone(self, why):
        self.dead = self.dead or why
        return Gone(self.dead)

    def refuse(self, why):
        self.refused = self.refused or why
        return Refused(self.refused)

    def check(self):
        if self.refused:
            raise Refused(self.refused)
        if self.dead:
            raise Gone(self.dead)

    def send(self, msg):
        data = self.dumps(msg).encode("ascii")
        if len(data) > CAP:
            raise ValueError("a value of over %d MiB cannot be sent" % (CAP >> 20))
        data = len(data).to_bytes(4, "big") + data
        try:
            sent = os.write(self.fd, data)
            while sent < len(data):
                sent += os.write(self.fd, data[sent:])
        except OSError as e:
            raise self.gone("the channel closed (%s)" % type(e).__name__)

    def readable(self):
        import select
        return bool(select.select([self.fd], [], [], 0)[0])

    def recv(self):
        buf = self.buf
        while True:
            if len(buf) >= 4:
                n = int.from_bytes(buf[:4], "big")
                if n > CAP:
                    raise self.refuse("a frame of %d bytes" % n)
                if len(buf) >= 4 + n:
                    data = bytes(buf[4:4 + n])
                    del buf[:4 + n]
                    break
            chunk = self.read(max(1 << 16, 4 + int.from_bytes(buf[:4], "big") - len(buf) if len(buf) >= 4 else 0))
            if not buf and len(chunk) >= 4 and len(chunk) == 4 + int.from_bytes(chunk[:4], "big"):
                data = chunk[4:]  # the usual case: one read, one whole frame
                break
            buf += chunk
        try:
            msg = self.loads(data.decode("ascii"))
        except (ValueError, RecursionError, MemoryError):
            raise self.refuse("a frame that is not JSON")
        if type(msg) is not list or not msg or type(msg[0]) is not str:
            raise self.refuse("a frame that is not a message")
        return msg

    def read(self, n):
        if self.exited and not self.readable():
            raise self.gone("the answer's process ended")
        self.reading = True
        try:
            chunk = os.read(self.fd, n)
        except OSError as e:
            raise self.gone("the channel closed (%s)" % type(e).__name__)
        finally:
            self.reading = False
        if not chunk:
            raise self.gone("the channel closed")
        return chunk

    def export(self, x):
        h = self.ids.get(id(x))
        if h is None:  # kept alive in `mine`, so the id stays this object's
            h = self.ids[id(x)] = len(self.mine)
            self.mine[h] = x
        return h

    def encode(self, x, depth=0):
        t = type(x)
        if x is None or t is bool or t is str or t is float:
            return x
        if t is int:
            return x if x.bit_length() < 10000 else {"i": hex(x)}
        if depth > DEPTH:
            raise ValueError("a value nested deeper than %d" % DEPTH)
        if t is list:
            return [self.encode(v, depth + 1) for v in x]
        tag = TAGS.get(t)
        if tag:
            return {tag: [self.encode(v, depth + 1) for v in x]}
        if t is dict:
            return {"d": [[self.encode(k, depth + 1), self.encode(v, depth + 1)] for k, v in x.items()]}
        if t is bytes:
            return {"b": x.hex()}
        if t is complex:
            return {"c": [x.real, x.imag]}
        if t is range:
            return {"R": [self.encode(x.start), self.encode(x.stop), self.encode(x.step)]}
        m = sys.modules.get("fractions")
        if m is not None and t is m.Fraction:
            return {"Q": [hex(x.numerator), hex(x.denominator)]}
        m = sys.modules.get("decimal")
        if m is not None and t is m.Decimal:
            return {"D": str(x)}
        m = sys.modules.get("collections")
        if m is not None and t in (m.Counter, m.OrderedDict, m.defaultdict):
            pairs = [[self.encode(k, depth + 1), self.encode(v, depth + 1)] for k, v in x.items()]
            if t is not m.defaultdict:
                return {"C" if t is m.Counter else "O": pairs}
            factory = FACTORIES.get(x.default_factory, False) if x.default_factory is None or isinstance(
                x.default_factory, type) else False
            if factory is not False:
                return {"DD": [factory, pairs]}
        if m is not None and t is m.deque:
            return {"dq": [[self.encode(v, depth + 1) for v in x], x.maxlen]}
        m = sys.modules.get("datetime")
        if m is not None and t in (m.date, m.datetime, m.time, m.timedelta):
            if t is m.timedelta:
                return {"T": ["timedelta", [x.days, x.seconds, x.microseconds]]}
            if t is m.date:
                return {"T": ["date", [x.year, x.month, x.day]]}
            if x.tzinfo is None and not x.fold:  # naive values only: a time zone is an object of its own
                fields = [x.hour, x.minute, x.second, x.microsecond]
                return {"T": ["time", fields] if t is m.time else ["datetime", [x.year, x.month, x.day, *fields]]}
        if t is self.proxy_type:
            return {"y": object.__getattribute__(x, "_h")}
        return self.encode_other(x, depth)

    def encode_other(self, x, depth):
        return {"h": self.export(x)}

    def decode(self, y, depth=0):
        t = type(y)
        if y is None or t is bool or t is int or t is float or t is str:
            return y
        if depth > DEPTH + 5:
            raise self.refuse("a value nested too deep")
        if t is list:
            return [self.decode(v, depth + 1) for v in y]
        if t is not dict or len(y) != 1:
            raise self.refuse("a value that is not encoded")
        (tag, v), = y.items()
        try:
            return self.decode_tag(tag, v, depth)
        except (Refused, Gone):
            raise
        except Exception as e:
            raise self.refuse("a malformed %r value (%s)" % (tag[:10], type(e).__name__))

    def decode_tag(self, tag, v, depth):
        if tag == "h":
            return self.proxy(v)
        if tag == "y":
            if type(v) is not int or v not in self.mine:
                raise KeyError(v)
            return self.mine[v]
        if tag in ("i", "b", "D") and type(v) is not str:
            raise TypeError(tag)
        if tag == "i":
            return int(v, 16)
        if tag == "b":
            return bytes.fromhex(v)
        if tag == "D":
            import decimal
            return decimal.Decimal(v)
        if type(v) is not list:
            raise TypeError(tag)
        if tag == "c" and len(v) == 2 and all(type(p) in (float, int) for p in v):
            return complex(v[0], v[1])
        if tag == "Q" and len(v) == 2 and all(type(p) is str for p in v):
            import fractions
            return fractions.Fraction(int(v[0], 16), int(v[1], 16))
        kinds = {"t": tuple, "S": set, "F": frozenset}
        if tag in kinds:
            return kinds[tag](self.decode(w, depth + 1) for w in v)
        if tag == "R" and len(v) == 3:
            return range(*(self.decode(w, depth + 1) for w in v))
        if tag in ("d", "C", "O"):
            import collections
            return {"d": dict, "C": collections.Counter, "O": collections.OrderedDict}[tag](self.pairs(v, depth))
        if tag == "DD" and len(v) == 2 and (v[0] is None or v[0] in FACTORY_NAMES):
            import collections
            return collections.defaultdict(FACTORY_NAMES.get(v[0]), self.pairs(v[1], depth))
        if tag == "dq" and len(v) == 2 and type(v[0]) is list and (v[1] is None or type(v[1]) is int):
            import collections
            return collections.deque((self.decode(w, depth + 1) for w in v[0]), v[1])
        if tag == "T" and len(v) == 2 and type(v[1]) is list and all(type(f) is int for f in v[1]):
            import datetime
            kinds = {"date": datetime.date, "datetime": datetime.datetime, "time": datetime.time,
                     "timedelta": datetime.timedelta}
            return kinds[v[0]](*v[1])
        raise ValueError(tag)

    def pairs(self, v, depth):
        out = []
        if type(v) is not list:
            raise TypeError("pairs")
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise TypeError("pair")
            out.append((self.decode(pair[0], depth + 1), self.decode(pair[1], depth + 1)))
        return dict(out)

    def proxy(self, h):
        if type(h) is not int:
            raise TypeError("handle")
        p = self.theirs.get(h)
        if p is None:
            p = self.theirs[h] = self.proxy_type(h)
            object.__setattr__(p, "_peer", self)
        return p

    def describe(self, e):
        """An exception as ["err", ...]: its class's name, nearest builtin base, text, class handle."""
        cls = type(e)
        base = next((c for c in cls.__mro__ if c.__module__ == "builtins"), BaseException)
        try:
            text = str(e)[:2000]
        except BaseException:
            text = ""
        own = None if cls.__module__ == "builtins" else self.export(cls)
        return ["err", str(cls.__name__)[:100], base.__name__, text, own]

    def exception(self, name, base, own):
        """This side's class for the other side's exception class: a builtin one by name, else a subclass
        of its nearest builtin base (made once per class), so that `except ValueError` catches it."""
        b = getattr(builtins, base, None) if type(base) is str else None
        if not (isinstance(b, type) and issubclass(b, Exception)):
            b = Exception  # BaseException-only ones (SystemExit, KeyboardInterrupt) fail the test, nothing more
        if own is None:
            cls = getattr(builtins, name, None)
            if isinstance(cls, type) and issubclass(cls, Exception):
                return cls
        key = (own, name, b)
        if key not in self.classes:
            self.classes[key] = type(name if name.isidentifier() else "AnswerError", (b,), {"__module__": "answer"})
        return self.classes[key]

    def rebuild(self, reply):
        if len(reply) != 5 or type(reply[1]) is not str or type(reply[3]) is not str or not (
                reply[4] is None or type(reply[4]) is int):
            raise self.refuse("a malformed error reply")
        cls = self.exception(reply[1][:100], reply[2], reply[4])
        try:
            return cls(reply[3])
        except Exception:  # e.g. UnicodeDecodeError wants five arguments
            return self.exception(reply[1][:100], "Exception", reply[4])(reply[3])

    def request(self, msg):
        """Send a request, serve the other side's nested requests, return the "ok" reply or raise the error."""
        self.check()
        self.send(msg)
        while True:
            reply = self.recv()
            if reply[0] == "ok":
                if len(reply) != 3 or type(reply[2]) is not list:
                    raise self.refuse("a malformed reply")
                return reply
            if reply[0] == "err":
                raise self.rebuild(reply)
            self.answer(reply)

    def answer(self, msg):
        """Serve one request of the other side, and reply."""
        try:
            value, mutated = self.serve(self, msg)
            out = ["ok", self.encode(value), mutated]
        except (Refused, Gone):
            raise
        except BaseException as e:  # noqa: BLE001 - the other side's error, sent back to it
            out = self.describe(e)
        try:
            self.send(out)
        except ValueError as e:  # over CAP: the error instead
            self.send(self.describe(e))
