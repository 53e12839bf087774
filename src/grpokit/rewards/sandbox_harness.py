"""The program that grades one `code_execution` answer inside the sandbox: `main()`, the judge's entry.

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

The trainer starts it (`sandbox.harness_argv`) as `python -I -B -c BOOT` with the source text of this
module, `sandbox_wire`, `sandbox_judge` and `sandbox_answer`, which the boot loads as those modules, since
the sandbox's interpreter may not have grpokit installed, nor see its files; so these modules import only
the standard library and each other. The trainer turns the verdict into a score (`sandbox_checks.judge`).
"""

import json
import os
import sys

from grpokit.rewards.sandbox_answer import answer
from grpokit.rewards.sandbox_judge import Remote, judge, serve_tests
from grpokit.rewards.sandbox_wire import Gone, Peer, Refused


def read_exact(fd, n):
    out = b""
    while len(out) < n:
        chunk = os.read(fd, n - len(out))
        if not chunk:
            raise EOFError("the job ended early")
        out += chunk
    return out


def main():
    import ctypes
    import resource
    import signal
    import socket
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
