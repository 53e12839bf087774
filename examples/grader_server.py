"""A remote grader: an HTTP service that scores completions, in the standard library alone.

Run it with `python examples/grader_server.py 8000` (port 0 picks a free one; it prints its URL), then
name its URL as a reward:

    [rewards]
    functions = ["http://127.0.0.1:8000/score"]

grpokit POSTs batches like {"prompts": [...], "completions": [...], "completion_ids": [...],
"answer": [...]} (every dataset column, one entry per completion) and reads back {"scores": [...]}:
here 1.0 when the completion contains the row's answer, 0.0 when it does not, and null (ungraded)
for a row without one. The protocol is in src/grpokit/rewards/remote.py. It listens on 127.0.0.1
only; serve ("0.0.0.0", port) to grade for other machines.
"""

import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def text(completion):  # chat prompts' completions are [{"role": "assistant", "content": ...}]
    return completion[-1]["content"] if isinstance(completion, list) else completion


class Grader(BaseHTTPRequestHandler):
    def do_POST(self):
        batch = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answers = batch.get("answer", [None] * len(batch["completions"]))
        scores = [None if a is None else float(str(a) in text(c)) for c, a in zip(batch["completions"], answers)]
        body = json.dumps({"scores": scores}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


if __name__ == "__main__":
    server = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1]) if len(sys.argv) > 1 else 8000), Grader)
    print(f"grading on http://127.0.0.1:{server.server_address[1]}/score", flush=True)
    server.serve_forever()
