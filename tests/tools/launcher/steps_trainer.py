"""A process the supervisor can watch as it watches `saccade rl`: it prints a line per "step",
starts a child in a session of its own (as torchrun starts its workers) and writes its pid to
RUN/grandchild.pid, then runs until RUN/finish exists (exit 0) or RUN/STOP does (it writes
RUN/STOPPED and exits 130, as `saccade rl` does after a stop on request). With --ignore-stop it never looks at STOP."""

import subprocess
import sys
import time
from pathlib import Path

run = Path(sys.argv[1])
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
(run / "grandchild.pid").write_text(str(child.pid))
step = 0
while True:
    step += 1
    print(f"step {step}", flush=True)
    if (run / "finish").exists():
        sys.exit(0)
    if (run / "STOP").exists() and "--ignore-stop" not in sys.argv:
        print("stopped on request", flush=True)
        (run / "STOPPED").write_text("stopped on request\n")
        sys.exit(130)
    time.sleep(0.2)
