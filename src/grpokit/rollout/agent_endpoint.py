"""Black-box agents: an OpenAI-compatible endpoint on grpokit's own sampler, every call recorded.

    def my_agent(base_url: str, row: dict) -> str | None:      # any program that uses the `openai` client
        client = openai.OpenAI(base_url=base_url, api_key="grpokit")
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}])
        ...                                                     # call tools, ask again, as the agent likes
        return reply.choices[0].message.content                 # its final answer (None: the model's last reply)

    grpokit.train(config, engine=agent_engine(my_agent))        # or [tools] agent = "agents.py:my_agent"

During a rollout every answer (B prompts x G) runs its agent in a thread with its own `base_url`
(`http://127.0.0.1:PORT/answers/<i>/v1`), so each call is attributed to its answer. The endpoint
(`POST .../chat/completions`, non-streaming) renders the request's `messages` and `tools` with the
model's chat template, and the trainer's thread samples every waiting call in one batch from the run's
own engine, at the run's sampling settings (`rollout.temperature`, `top_p`, `top_k`: a request's own
`temperature` is ignored, since the tokens train under the run's distribution). The reply carries the
text and the calls the tool-call parser reads in it (`tool_calls`, OpenAI's form).

The tokens are kept, never re-tokenized (as AReaL, ART and rLLM record them): the first call's rendered
prompt is the training row's prompt, its sampled tokens the row's first turn; a later call whose rendering
continues the tokens so far (or whose messages extend the previous call's with the reply it got) adds
what the template puts in between (tool results, the agent's own messages) as context tokens (tool_mask
1, log-prob 0, no loss) and its sampled tokens as the next turn. So the conversation trains as if grpokit
had run it. A call that rewrites the history instead is served but not recorded: the row ends before it
(metric `agent/rewritten_calls`). The reward functions see the conversation as messages, the agent's
final answer last (the string it returned, else the model's last reply).

Bounds: `rollout.max_new_tokens` for a row's tokens (sampled and inserted), `tools.max_calls` tool rounds
(so max_calls + 1 model calls an answer), the model's context (`max_position_embeddings`: a call is sampled
at most up to it), `time_limit_s` for all agents of a batch. A call past a bound gets HTTP 400 with the reason
(the `openai` client raises `BadRequestError`, which it does not retry); an agent still running at the
deadline is abandoned (its thread left to finish, its later calls refused) and, as one that raised, is a
failure: its answer is marked truncated and keeps what was recorded. A request the endpoint cannot serve
(not a JSON object, a message without a known role or with content that is neither text nor content parts,
`n` other than 1, `stream = true`) is HTTP 400 too, in OpenAI's error shape; `GET .../models` lists the one
model every name stands for.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import threading
import time
import uuid
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from grpokit.errors import SetupError
from grpokit.rollout.tools import CALL, call_parser

Agent = Callable[[str, dict], "str | None"]
ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # what OpenAI's chat API accepts
MODEL = "grpokit"  # the name `GET /models` lists (any name a request gives is served by the run's policy)


class AgentError(ValueError):
    """A call the endpoint refuses: answered with HTTP 400 and this text."""


@dataclasses.dataclass
class AnswerRecord:
    """One answer's record: the row's prompt, its tokens so far, the messages of its last call."""

    prompt: list[int] | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    is_context: list[int] = dataclasses.field(default_factory=list)
    messages: list[dict] | None = None  # the last recorded call's messages, its reply appended
    conversation: list[dict] = dataclasses.field(default_factory=list)  # what the reward functions see
    calls: int = 0
    tool_calls: Counter = dataclasses.field(default_factory=Counter)
    truncated: bool = False
    ended: bool = False  # the row takes no more tokens (a rewrite, the budget)
    closed: bool = False  # the agent finished or was abandoned: its calls are refused
    failed: str | None = None
    rewritten: int = 0


@dataclasses.dataclass
class PendingCall:
    answer: int
    prompt: list[int]  # the tokens to sample from: the recorded context, or the rendering (not recorded)
    max_tokens: int
    record: bool
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    tokens: list[int] = dataclasses.field(default_factory=list)
    logps: list[float] = dataclasses.field(default_factory=list)
    finished: bool = False  # ended with an end-of-turn token


class AgentEndpoint:
    """`/answers/<i>/v1/chat/completions` on 127.0.0.1:`port` (0: a free one), served from threads; the
    calls wait in `requests` until the trainer's thread samples them (`AgentEngine.generate`)."""

    def __init__(self, tokenizer, port: int = 0, max_positions: int | None = None):
        self.tokenizer, self.parse = tokenizer, call_parser(tokenizer)
        self.requests: queue.Queue[PendingCall] = queue.Queue()
        self.answers: list[AnswerRecord] = []
        self.lock = threading.Lock()
        self.budget, self.max_calls = 0, 8
        self.max_positions = max_positions  # the model's context: a call's prompt and answer fit in it
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def handle(self):
                try:
                    super().handle()
                except ConnectionError:  # the client left before its reply (BrokenPipe, reset): no one to tell
                    pass

            def do_POST(self):  # noqa: N802 - http.server's name
                endpoint._serve(self, endpoint._post)

            def do_GET(self):  # noqa: N802
                endpoint._serve(self, endpoint._get)

            def log_message(self, *args):  # quiet: the metrics say what happened
                pass

        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        except OSError as e:
            raise SetupError(_port_message(port, e)) from None
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True, name="grpokit-agent-endpoint").start()

    @staticmethod
    def probe(port: int) -> None:
        """SetupError now when `port` cannot be bound on 127.0.0.1 (the endpoint binds it at the first batch)."""
        import socket

        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                raise SetupError(_port_message(port, e)) from None

    def base_url(self, answer: int) -> str:
        return f"http://127.0.0.1:{self.port}/answers/{answer}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _serve(self, http: BaseHTTPRequestHandler, answer: Callable) -> None:
        """Reply to one request with `answer(http)`'s body, or HTTP 400 in OpenAI's error shape."""
        status = 200
        try:
            body = answer(http)
        except AgentError as e:
            status, body = 400, _error(f"grpokit: {e}")
        except (ValueError, KeyError, TypeError) as e:
            status, body = 400, _error(f"grpokit: bad request ({e})")
        data = json.dumps(body).encode()
        http.send_response(status)
        http.send_header("Content-Type", "application/json")
        http.send_header("Content-Length", str(len(data)))
        http.end_headers()
        http.wfile.write(data)

    @staticmethod
    def _answer_index(http: BaseHTTPRequestHandler, *tail: str) -> int:
        """The answer a path `/answers/<i>/v1/<tail>` is for."""
        parts = http.path.split("?")[0].strip("/").split("/")
        if len(parts) != 3 + len(tail) or parts[0] != "answers" or parts[2:] != ["v1", *tail] \
                or not parts[1].isdigit():
            raise AgentError(f"unknown path {http.path!r}; POST {{base_url}}/chat/completions or GET "
                             "{base_url}/models")
        return int(parts[1])

    def _get(self, http: BaseHTTPRequestHandler) -> dict:
        """`GET /models`: OpenAI's list, one model (every name a request gives is the run's policy)."""
        self._answer_index(http, "models")
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "grpokit"}]}

    def _post(self, http: BaseHTTPRequestHandler) -> dict:
        i = self._answer_index(http, "chat", "completions")
        size = int(http.headers.get("Content-Length") or 0)
        if size < 0:
            raise AgentError(f"Content-Length {size} is negative")
        try:
            request = json.loads(http.rfile.read(size) or b"{}")
        except RecursionError:
            raise AgentError("the request body is nested too deeply to read") from None
        return self._complete(i, _checked(request))

    def _complete(self, i: int, request: dict) -> dict:
        """One call of answer i: rendered, queued for the sampler, recorded, answered as OpenAI does."""
        messages, tools = request["messages"], request.get("tools") or None
        with self.lock:
            if not 0 <= i < len(self.answers) or self.answers[i].closed:
                raise AgentError(f"answer {i} is not being sampled now (its agent finished or ran past its time "
                                 "limit)")
            answer = self.answers[i]
            if answer.calls > self.max_calls:
                raise AgentError(f"this answer has made its {self.max_calls + 1} model calls (tools.max_calls = "
                                 f"{self.max_calls} tool rounds); give the final answer")
            answer.calls += 1
            try:
                rendered = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                              tokenize=True, return_dict=False)
            except Exception as e:  # noqa: BLE001 - jinja's errors and the template's own raise_exception
                raise AgentError(f"the model's chat template cannot render these messages ({type(e).__name__}: "
                                 f"{e})") from None
            inserted = None if answer.ended else self._inserted(answer, messages, rendered, tools)
            record = inserted is not None
            context = (list(rendered) if answer.prompt is None else answer.prompt + answer.tokens) + inserted \
                if record else list(rendered)
            if self.max_positions is not None and len(context) >= self.max_positions:
                answer.ended = answer.truncated = True  # nothing of this call is recorded: the row stays in context
                raise AgentError(f"the conversation is {len(context)} tokens, and the model's context "
                                 f"(max_position_embeddings) is {self.max_positions} positions, so nothing is left "
                                 "to answer with; shorten the messages")
            if record:
                if answer.messages is not None and _same(messages[:len(answer.messages)], answer.messages):
                    answer.conversation += messages[len(answer.messages):]  # tool results, the agent's own
                if answer.prompt is None:
                    answer.prompt = list(rendered)
                self._append(answer, inserted, [0.0] * len(inserted), 1)
            elif not answer.ended:
                answer.rewritten += 1
                answer.ended = True
            room = self.budget - len(answer.tokens) if record else self.budget
            if room <= 0:
                answer.ended = answer.truncated = True
                raise AgentError("this answer has used its rollout.max_new_tokens tokens; give the final answer")
            limit = request.get("max_completion_tokens") or request.get("max_tokens") or room
            if self.max_positions is not None:
                room = min(room, self.max_positions - len(context))
        job = PendingCall(i, context, min(limit, room), record)
        self.requests.put(job)
        job.done.wait()
        if job.tokens is None:  # the batch's time ran out while it waited
            raise AgentError("the agents' time limit ran out")
        return self._reply(answer, job, messages, tools, request.get("model", MODEL))

    def _inserted(self, answer: AnswerRecord, messages: list[dict], rendered: list[int], tools) -> list[int] | None:
        """What the template puts between the recorded tokens and this call's turn; None where it rewrote them."""
        if answer.prompt is None:
            return []
        context = answer.prompt + answer.tokens
        if rendered[:len(context)] == context:
            return list(rendered[len(context):])
        previous = answer.messages or []
        if len(messages) > len(previous) and _same(messages[:len(previous)], previous):
            # the sampled tokens stand for the reply: render what follows it after grpokit's own messages (the
            # agent's echo may differ in form: key order, ids), cut where the reply's turn ends, as tool_suffix_ids
            render = self.tokenizer.apply_chat_template
            base = render(previous, tools=tools, tokenize=True, return_dict=False)
            full = render(previous + messages[len(previous):], tools=tools, add_generation_prompt=True, tokenize=True,
                          return_dict=False)
            eos = [k for k, t in enumerate(base) if t == self.tokenizer.eos_token_id]
            base = base[:eos[-1] + 1] if eos else base
            if full[:len(base)] == base:
                return list(full[len(base):])
        return None

    @staticmethod
    def _append(answer: AnswerRecord, tokens: list[int], logps: list[float], context: int) -> None:
        answer.tokens += tokens
        answer.logps += logps
        answer.is_context += [context] * len(tokens)

    def _reply(self, answer: AnswerRecord, job: PendingCall, messages: list[dict], tools, model: str) -> dict:
        text = self.tokenizer.decode(job.tokens, skip_special_tokens=True)
        calls = self.parse(self.tokenizer.decode(job.tokens), prefix="", tools=tools)
        tool_calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                       "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                      for c in calls if c.error is None]
        content = CALL.sub("", text).strip() if tool_calls else text
        message = {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        with self.lock:
            if job.record:
                self._append(answer, job.tokens, job.logps, 0)
                answer.truncated = not job.finished
                answer.ended = answer.ended or not job.finished
                answer.messages = list(messages) + [message]
                answer.conversation.append({"role": "assistant", "content": content})
                answer.tool_calls.update(c["function"]["name"] for c in tool_calls)
        finish = ("tool_calls" if tool_calls else "stop") if job.finished else "length"
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(job.prompt), "completion_tokens": len(job.tokens),
                          "total_tokens": len(job.prompt) + len(job.tokens)}}


def _error(message: str) -> dict:
    """An HTTP 400 body in OpenAI's error shape."""
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}


def _checked(request) -> dict:
    """A chat completion request the endpoint can serve, else AgentError naming what is wrong."""
    if not isinstance(request, dict):
        raise AgentError(f"the request body must be a JSON object, got a JSON {type(request).__name__}")
    if request.get("stream"):
        raise AgentError("stream = true is not served; call without streaming")
    if request.get("n") not in (None, 1):
        raise AgentError(f"n = {request['n']!r} is not served: one choice per call; call again for another answer")
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise AgentError(f"{key} must be a positive integer, got {value!r}")
    messages = request.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AgentError("messages must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict):
            raise AgentError(f"messages[{k}] must be an object with a role and content, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise AgentError(f"messages[{k}].role is {m.get('role')!r}; it must be one of {', '.join(ROLES)}")
        content = m.get("content")
        parts_ok = isinstance(content, list) and all(isinstance(p, dict) and "type" in p for p in content)
        if not (isinstance(content, str) or parts_ok or (content is None and m["role"] == "assistant")):
            raise AgentError(f"messages[{k}].content must be a string or a list of content parts "
                             f"({{\"type\": \"text\", ...}}), got {type(content).__name__}"
                             + (" (an assistant message may omit it)" if m["role"] == "assistant" else ""))
        calls = m.get("tool_calls")
        if calls is not None and not (isinstance(calls, list) and all(
                isinstance(c, dict) and isinstance(c.get("function", {}), dict) for c in calls)):
            raise AgentError(f"messages[{k}].tool_calls must be a list of calls ({{\"id\": ..., \"type\": "
                             f"\"function\", \"function\": {{\"name\": ..., \"arguments\": ...}}}})")
    tools = request.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise AgentError(f"tools must be a list of tool definitions, got {type(tools).__name__}")
    return request


def _port_message(port: int, e: OSError) -> str:
    return (f"tools.agent_port: port {port} on 127.0.0.1 is not available for the agents' endpoint "
            f"({e.strerror or e}); free it, or set tools.agent_port = 0 (agent_engine(port=0)) for a free one")


def _same(a: list[dict], b: list[dict]) -> bool:
    """Messages alike in what the template renders of them: roles, text, the names of the calls."""
    def key(m: dict):
        calls = [(c.get("function") or c).get("name") for c in m.get("tool_calls") or []]
        content = m.get("content") or ""
        return m.get("role"), content.strip() if isinstance(content, str) else json.dumps(content, default=str), calls
    return [key(m) for m in a] == [key(m) for m in b]

