"""The code_execution judge: tests run in a process the answer never ran in, against handles on the
answer's objects. Honest answers grade as plain Python would (objects, callbacks, in-place changes,
exceptions, generators both ways, the stdlib's value types); what crosses the channel cannot reach the
judge's state (callbacks the answer calls are limited, forged frames are refused).

Each case runs under `sandbox = "none"` and, where it is in force, under bubblewrap.
"""

from __future__ import annotations

import os

import pytest

from grpokit.rewards.sandbox import code_execution_reward, sandbox_isolation

LEVEL, MESSAGE = sandbox_isolation()
REQUIRED = os.environ.get("GRPOKIT_REQUIRE_SANDBOX") == "1"
SANDBOXES = [pytest.param("none", id="rlimits"),
             pytest.param("bubblewrap", id="bubblewrap", marks=pytest.mark.skipif(
                 LEVEL != "bubblewrap" and not REQUIRED, reason=f"bubblewrap is not in force here ({MESSAGE})"))]


def _reward(sandbox):
    return code_execution_reward(time_limit=5.0, memory_mb=512, workers=4, sandbox=sandbox)


OBJECTS = '''
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
        return self
    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()
    def __len__(self):
        return len(self.items)
class Empty(ValueError):
    pass
def check_positive(x):
    if x <= 0:
        raise Empty("not positive: %r" % x)
    return x
def sort_in_place(xs, table=None):
    xs.sort()
    if table is not None:
        table["n"] = len(xs)
def apply(f, *args, **kwargs):
    return f(*args, **kwargs)
def squares(n):
    for i in range(n):
        yield i * i
def same(x):
    return x
def pair():
    node = Stack()
    return node, node
def count(s):
    from collections import Counter
    return Counter(s)
def next_day(d):
    from datetime import timedelta
    return d + timedelta(days=1)
'''

OBJECT_TESTS = [
    "s = Stack()\ns.push(1).push(2)\nassert len(s) == 2 and s.pop() == 2 and s.items == [1]",
    "try:\n    Stack().pop()\nexcept IndexError as e:\n    assert 'empty' in str(e)\nelse:\n    raise AssertionError",
    "try:\n    check_positive(-1)\nexcept Empty as e:\n    assert isinstance(e, ValueError)\nelse:\n    assert False",
    "xs, t = [3, 1, 2], {}\nsort_in_place(xs, table=t)\nassert xs == [1, 2, 3] and t == {'n': 3}",
    "assert apply(lambda a, b=0: a + b, 2, b=3) == 5 and apply(len, 'abc') == 3",
    "out = []\napply(out.append, 7)\nassert out == [7] and apply(str.upper, 'x') == 'X'",
    "assert list(squares(4)) == [0, 1, 4, 9] and sum(squares(3)) == 5",
    "s = Stack()\nassert same(s) is s and same(None) is None\na, b = pair()\nassert a is b",
    "s = Stack()\ns.items = [5]\nassert s.pop() == 5",
    "class Node:\n    def __init__(self, v):\n        self.v = v\nassert apply(lambda n: n.v, Node(4)) == 4",
    "assert apply(sum, range(5)) == 10 and apply(sum, (x * 2 for x in [1, 2])) == 6",
    "from datetime import date\nassert count('aab') == {'a': 2, 'b': 1} and count('a')['z'] == 0\n"
    "assert next_day(date(2020, 2, 28)) == date(2020, 2, 29)",
]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_honest_answers_using_objects_callbacks_and_exceptions_grade_as_python_would(sandbox):
    reward = _reward(sandbox)
    assert reward([OBJECTS], [OBJECT_TESTS]) == [1.0], reward.last_grades
    wrong = OBJECTS.replace("xs.sort()", "xs.reverse()").replace("yield i * i", "yield i")
    assert reward([wrong], [OBJECT_TESTS]) == [10 / 12]


ESCAPES = '''
VERDICT = b'{"passed": [true, true], "end": "ok", "why": null}'
CODE = "(__import__('os').write(3, %r), __import__('os')._exit(0))" % VERDICT  # the judge's result file is fd 3
def builtin_eval(scope):
    b = scope["__builtins__"]
    return (b["eval"] if isinstance(b, dict) else b.eval)(CODE)
def escape(ev, ex, op, ga, lam, gen, box):
    """Each way to run code in the judge through what the tests hand over: any that worked forges 1.0."""
    for attempt in (lambda: ev(CODE), lambda: ex(CODE), lambda: op("/proc/self/fd/3", "wb").write(VERDICT),
                    lambda: builtin_eval(ga(lam, "__globals__")), lambda: builtin_eval(lam.__globals__),
                    lambda: builtin_eval(gen.gi_frame.f_globals), lambda: builtin_eval(box.m.__func__.__globals__),
                    lambda: builtin_eval(ga(box, "__init__").__globals__)):
        try:
            attempt()
        except Exception:
            pass
def add(a, b):
    return 0
'''

ESCAPE_TESTS = ["assert add(2, 3) == 5",
                "class Box:\n    def m(self):\n        return 1\n"
                "assert escape(eval, exec, open, getattr, lambda s: s, (x for x in [1]), Box()) is None"]


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_what_the_tests_hand_the_answer_cannot_run_code_in_the_judge(sandbox):
    """The tests pass eval, exec, open, getattr, a lambda, a generator and an object of their own to the
    answer, which tries to write a passing verdict into the judge's result file through each: the judge
    refuses every such call or attribute, so the wrong `add` still fails."""
    reward = _reward(sandbox)
    assert reward([ESCAPES], [ESCAPE_TESTS]) == [0.5], reward.last_grades


FORGED_FRAMES = {
    "a request before its names": "import json, struct\nm = json.dumps(['call', 0, [], []]).encode()\n"
                                  "import os\nos.write(3, struct.pack('>I', len(m)) + m)\n",
    "a frame that is not JSON": "import os\nos.write(3, b'\\x00\\x00\\x00\\x05hello')\n",
    "a huge frame length": "import os\nos.write(3, b'\\xff\\xff\\xff\\xff')\n",
    "a handle on the judge's objects it was never given": (
        "import json, os, struct\nm = json.dumps(['ready', [['add', 'v', {'y': 0}]]]).encode()\n"
        "os.write(3, struct.pack('>I', len(m)) + m)\nimport time\ntime.sleep(10)\n"),
}


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_frames_the_harness_did_not_ask_for_are_refused(sandbox):
    reward = _reward(sandbox)
    good = "def add(a, b):\n    return a + b\n"
    scores = reward([code + good for code in FORGED_FRAMES.values()] + [good], [["assert add(2, 3) == 5"]] * 5)
    assert scores == [0.0] * 4 + [1.0]
    assert all(g.refused and g.reason.startswith("the answer wrote") for g in reward.last_grades[:4]), \
        reward.last_grades


@pytest.mark.parametrize("sandbox", SANDBOXES)
def test_the_answers_modules_and_names_reach_the_tests_as_the_judges_own(sandbox):
    """`math` imported (and patched) by the answer is the judge's clean `math` in the tests; plain globals
    cross by value; a global shadowing a builtin (`sum`) does not replace the tests' builtin."""
    code = ("import math, collections\nmath.sqrt = lambda x: 3.0\nLIMIT = [1, 2]\n"
            "def sum(*a):\n    return 6\ndef root(x):\n    return x ** 0.5\n")
    tests = ["assert math.sqrt(4) == 2.0 == root(4)", "assert LIMIT == [1, 2] and sum([1, 2]) == 3",
             "assert collections.Counter('aab')['a'] == 2"]
    assert _reward(sandbox)([code], [tests]) == [1.0]
