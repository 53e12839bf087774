"""The program that grades one `code_execution` answer inside the sandbox (`python -I -B -c HARNESS`).

Two processes, and the answer's code runs in only one of them:

- The judge is the process the trainer starts. It reads the first part of its job from stdin (the
  limits and the answer's code: never the tests), becomes uid 65534 where it must, makes itself
  non-dumpable (so that no process of the same uid can open its `/proc/<pid>/fd`, read its memory or
  ptrace it), and forks the answer's process. Only then does it read the tests, so they never exist
  in the answer's memory. It runs them itself (`sandbox_judge`), with the answer's names bound to
  handles whose every use is a request over a socket to the answer's process (`sandbox_wire`), and
  alone holds the result file the trainer reads: one JSON object, the verdict.
- The answer's process keeps only its end of the socket (the result file and stdin are closed;
  stdout and stderr are /dev/null), runs the answer's code, sends its top-level names and then
  serves the judge's requests on its own objects until told to end. It never sees a test, an
  expected value or a verdict: whatever it does to its own interpreter (patched builtins, a patched
  `math`, a lying `__eq__`, walking its frames or the garbage collector, threads, signal handlers,
  forks) can change only the values it answers with, which the judge compares as plain data.

The trainer turns the verdict into a score (`sandbox_checks.judge`).
"""

from grpokit.rewards.sandbox_judge import JUDGE
from grpokit.rewards.sandbox_wire import WIRE

MAIN = r'''
def read_exact(fd, n):
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the job ended early")
        out += chunk
    return out


def main():
    import ctypes, resource, signal, socket
    job = json.loads(read_exact(0, int(read_exact(0, 16), 16)))  # exactly the first part: not the tests
    result, job_in = os.dup(1), os.dup(0)
    if job["uid"] is not None:
        os.chown(".", job["uid"], job["uid"])
        os.setgroups([])
        os.setgid(job["uid"])
        os.setuid(job["uid"])
    if ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE 0
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    def limit(kind, value):
        hard = resource.getrlimit(kind)[1]
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))
    nproc = job["nproc"]
    if job["nproc_above_mine"]:
        me = os.getuid()
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat("/proc/" + pid).st_uid == me:
                    nproc += len(os.listdir("/proc/%s/task" % pid))
            except OSError:
                pass
    mine, theirs = (s.detach() for s in socket.socketpair())
    pid = os.fork()  # before the process limit: where answers share a uid, a sibling's fork bomb must not stop it
    limit(resource.RLIMIT_NPROC, nproc)
    limit(resource.RLIMIT_CPU, job["cpu"])
    limit(resource.RLIMIT_FSIZE, job["fsize"])
    limit(resource.RLIMIT_CORE, 0)
    if job["memory"]:
        limit(resource.RLIMIT_AS, job["memory"])
    if pid == 0:
        os.dup2(theirs, 3)
        os.closerange(4, 1 << 16)
        answer(job["code"], 3)
    os.close(theirs)
    peer = Peer(mine, Remote, serve_tests)
    def on_child(signum, frame):  # the answer's process ended: stop waiting on it (its children may hold the socket)
        if peer.exited or os.waitpid(pid, os.WNOHANG)[0] != pid:
            return
        peer.exited = True
        if peer.reading and not peer.readable():
            raise peer.gone("the answer's process ended")
    signal.signal(signal.SIGCHLD, on_child)
    on_child(None, None)  # it may have ended before the handler was in place
    tests = json.loads(read_all(job_in))
    os.close(job_in)
    if hasattr(sys, "set_int_max_str_digits"):
        sys.set_int_max_str_digits(0)
    sys.setrecursionlimit(3000)
    try:
        passed, why, end = judge(peer, tests)
    except Refused:
        passed, why, end = [], None, "refused"
    except Gone:
        passed, why, end = [], None, "died"
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if peer.refused:
        end, why = "refused", peer.refused
    elif peer.dead:
        end, why = "died", peer.dead
    os.write(result, json.dumps({"passed": passed, "end": end, "why": why}).encode("ascii"))
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    os._exit(0)


def read_all(fd):
    out = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            return b"".join(out)
        out.append(chunk)
'''

ANSWER = r'''
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
'''

HARNESS = '__name__ = "grpokit_harness"\n' + WIRE + JUDGE + ANSWER + MAIN + "\nmain()\n"
