"""A process in a vLLM server's place for the client's watch on busy servers: GET /health answers
200 (each one counted), GET /probes says how many it answered, and a POST to any path answers
after the seconds its JSON body asks for ({"seconds": S}) with {"from": PORT}: a long generation.
Each request on a thread of its own, so /health answers while a POST is under way. Frozen with
SIGSTOP, it holds its port (the kernel still accepts connections) and answers nothing: a hung
server. Usage: python slow_server.py PORT"""

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[1])
answered = 0
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    def reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        global answered
        if self.path == "/health":
            with lock:
                answered += 1
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.path == "/probes":
            self.reply({"health": answered})
        else:
            self.send_error(404)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        time.sleep(float(body.get("seconds", 0)))
        self.reply({"from": PORT})

    def log_message(self, fmt, *args):
        pass


if __name__ == "__main__":
    ThreadingHTTPServer.daemon_threads = True
    ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
