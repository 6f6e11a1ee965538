"""A process `saccade launch`'s supervisor can watch as it watches a vLLM server: it answers GET
/health on the port given, prints a line per request, and runs until signalled. With --fail it
exits with status 3 before it listens (a server that cannot start); with --delay S it waits S
seconds before it binds its port (a server loading its model)."""

import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, fmt, *args):
        print("served", self.path, flush=True)


if __name__ == "__main__":
    if "--fail" in sys.argv:
        print("cannot start: --fail", flush=True)
        sys.exit(3)
    if "--delay" in sys.argv:
        time.sleep(float(sys.argv[sys.argv.index("--delay") + 1]))
    print(f"listening on {sys.argv[1]}", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
