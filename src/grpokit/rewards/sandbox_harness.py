"""The program that runs one `code_execution` answer inside the sandbox (`python -I -B -c HARNESS`).

Two processes, so that the answer never holds the way out:

- The relay (the process the trainer starts) reads the job from stdin, becomes uid 65534 where it
  must, sets the limits, makes itself non-dumpable (so that no process of the same uid can open its
  `/proc/<pid>/fd`, read its memory or ptrace it), and forks the answer's process. It never runs a
  line of the answer's or the tests' code. It alone holds the result file the trainer reads (its
  fd 1), and writes to it one JSON object: the lines the answer's process sent that carried this
  run's token, the count of those that did not, and how that process ended.
- The answer's process closes every descriptor but a pipe to the relay (the result file is gone,
  stdin/stdout/stderr are /dev/null), runs the answer, then each test. It reports over the pipe
  only what the trainer asked for: the values of the expressions the tests' asserts were turned
  into (`rewards.sandbox_checks`), encoded as plain data, and whether each test ran to its end.
  The harness's own helpers run on a private copy of the builtins and on references taken before
  the answer ran, so that patching `builtins`, `sys.modules`, `exec` or `json` changes nothing here.

What each assert expected never enters the sandbox: the trainer keeps it and compares the values
itself. A report the answer writes on its own (into the pipe, with or without the token) is at best
a value it cannot know to be right, and a line without the token makes the trainer score the whole
answer 0.0.
"""

HARNESS = r'''
def main():
    import ctypes, json, os, resource, sys
    job = json.loads(sys.stdin.read())
    result = os.fdopen(os.dup(1), "w", encoding="utf-8")
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
    def limits():
        limit(resource.RLIMIT_NPROC, nproc)
        limit(resource.RLIMIT_CPU, job["cpu"])
        limit(resource.RLIMIT_FSIZE, job["fsize"])
        limit(resource.RLIMIT_CORE, 0)
        if job["memory"]:
            limit(resource.RLIMIT_AS, job["memory"])
    token = os.urandom(16).hex()
    r, w = os.pipe()
    pid = os.fork()  # before the process limit: where answers share a uid, a sibling's fork bomb must not stop it
    limits()
    if pid == 0:
        os.close(r)
        result.close()
        os.dup2(w, 3)
        os.closerange(4, 1 << 16)
        answer(job["code"], job["tests"], token, 3)
    os.close(w)
    os.set_blocking(r, False)
    relay(r, pid, token, result, job["cap"])

def relay(r, pid, token, result, cap):
    import json, os, select
    got, status, lines, stray, size, mark = b"", None, [], 0, 0, token.encode()
    while True:
        if status is None:
            done, status = os.waitpid(pid, os.WNOHANG)
            status = status if done else None
            if status is None:
                select.select([r], [], [], 0.05)
        try:
            chunk = os.read(r, 1 << 16)
        except BlockingIOError:
            chunk = None
        if chunk == b"" and status is None:  # the answer's process closed the pipe: wait for its end
            status = os.waitpid(pid, 0)[1]
        if chunk:
            size += len(chunk)
            if size > cap:
                break
            got += chunk
            *whole, got = got.split(b"\n")
            for line in whole:
                head, _, rest = line.partition(b" ")
                if head == mark and rest:
                    lines.append(rest.decode("utf-8", "replace"))
                    if rest == b"done":
                        break
                else:
                    stray += 1
            if lines and lines[-1] == "done":
                break
        elif status is not None:  # the answer's process ended and the pipe is drained (or held by its children)
            break
    if status is None:
        status = os.waitpid(pid, 0)[1] if lines and lines[-1] == "done" else -1
    stray += bool(got.strip())
    result.write(json.dumps({"lines": lines, "stray": stray, "overflow": size > cap,
                             "status": status}))
    result.flush()
    os._exit(0)

def answer(code, tests, token, fd):
    import builtins, json
    from os import _exit, write
    private = {"__builtins__": dict(vars(builtins))}
    exec(HELPERS, private)
    send, encode = private["send"], private["encode"]
    run = builtins.exec, builtins.compile, BaseException, len, str, enumerate
    private.update(TOKEN=token, FD=fd, write=write, dumps=json.JSONEncoder(ensure_ascii=True).encode)
    namespace, pristine = {"__name__": "__main__", "__builtins__": builtins}, dict(vars(builtins))
    try:
        run[0](run[1](code, "<answer>", "exec"), namespace)
    except run[2]:
        send("answer raised")
        _exit(0)
    send("answer ok")
    for i, test in run[5](tests):
        def check(k, ops, *values, _i=i):
            send("check %d %d %s" % (_i, k, encode(ops, values)))
        namespace["__grpokit_check__"] = check
        namespace["__builtins__"] = pristine.copy()  # the tests see the builtins as they were before the answer
        try:
            run[0](run[1](test, "<test %d>" % i, "exec"), namespace)
        except run[2]:
            send("raised %d" % i)
            continue
        send("end %d" % i)
    send("done")
    _exit(0)

HELPERS = """
def send(text):
    try:
        write(FD, (TOKEN + " " + text + "\\n").encode("utf-8", "surrogatepass"))
    except BaseException:
        pass

PLAIN = {type(None): None, bool: None, int: "i", float: "f", complex: "c", str: "s", bytes: "b",
         list: "l", tuple: "t", dict: "d", set: "S", frozenset: "F"}

def plain(x, depth=0):
    kind = type(x)
    if depth > 50:
        raise ValueError("nested deeper than 50")
    if kind not in PLAIN:
        to = getattr(x, "tolist", None)  # numpy arrays and scalars
        if depth == 0 and callable(to):
            return plain(to(), depth + 1)
        raise TypeError(kind.__name__)
    tag = PLAIN[kind]
    if tag is None:
        return x
    if tag == "i":
        return {"i": str(x)}
    if tag == "f":
        return {"f": x.hex()}
    if tag == "c":
        return {"c": [x.real.hex(), x.imag.hex()]}
    if tag == "s":
        return {"s": x}
    if tag == "b":
        return {"b": x.hex()}
    if tag == "d":
        return {"d": [[plain(k, depth + 1), plain(v, depth + 1)] for k, v in x.items()]}
    return {tag: [plain(v, depth + 1) for v in x]}

def plain_or_none(x):
    try:
        plain(x)
        return True
    except BaseException:
        return False

def encode(ops, values):
    try:
        out = dumps([plain(v) for v in values])
        if len(out) > 1 << 20:
            raise ValueError("over 1 MiB")
        return "v " + out
    except BaseException as e:
        reason = type(e).__name__ + ": " + str(e)[:80]
    if ops is None or (ops != "truth" and any(plain_or_none(v) for v in values)):
        return "x " + dumps(reason)  # a plain value next to one that is not: judged as plain data, it fails
    try:  # no expected value is hidden here: the answer's own objects decide, as plain Python would
        return "r " + dumps(bool(values[0]) if ops == "truth" else compare(ops, values))
    except BaseException:
        return "x " + dumps(reason)

OPS = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "lt": lambda a, b: a < b,
       "le": lambda a, b: a <= b, "gt": lambda a, b: a > b, "ge": lambda a, b: a >= b,
       "is": lambda a, b: a is b, "is_not": lambda a, b: a is not b, "in": lambda a, b: a in b,
       "not_in": lambda a, b: a not in b}

def compare(ops, values):
    for op, a, b in zip(ops, values, values[1:]):
        if not OPS[op](a, b):
            return False
    return True
"""

main()
'''
