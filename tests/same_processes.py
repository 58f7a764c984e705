"""Run one script's main() for several configurations, one after another, in the same N
processes: what a test matrix over DDP's knobs needs, without paying the start of N fresh
processes (about 5 s of `import torch, torchvision` each on a 2-core CPU) for every cell.

Each configuration is a whole run of the script's own parse_args() and main(): a new process
group over env:// on a port of its own, DDP, training, the script's checks, then
destroy_process_group() and a reset of torch.compile's caches. How processes start is not
what a matrix cell tests; the scripts' own launch tests (torchrun, --spawn, one process)
cover that. Started by launch.run_in_same_processes (03's knob matrix, and cases of 02, 05
and 06) as N processes with RANK, WORLD_SIZE and MASTER_ADDR set:

  python tests/same_processes.py SCRIPT '[{"port": 29500, "args": ["--epochs", "1"]}, ...]'

Rank 0 prints "### config I" before each run's output. Any failure prints its traceback and
ends the process with exit 1; the test's deadline ends the others.

SLOW_COMPILE=R:S registers a torch.compile backend, slow_aot_eager: aot_eager, which on rank R
first sleeps S seconds. It makes a real compile-time skew between ranks, as a slower node or a
cold compile cache would.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

from launch import load_script


def register_slow_backend() -> None:
    slow_rank, seconds = os.environ.get("SLOW_COMPILE", "-1:0").split(":")
    delay = [float(seconds) if os.environ["RANK"] == slow_rank else 0.0]

    @torch._dynamo.register_backend
    def slow_aot_eager(graph, example_inputs):
        time.sleep(delay.pop() if delay else 0.0)  # once: the first (sub)graph compiled
        return torch._dynamo.lookup_backend("aot_eager")(graph, example_inputs)


def main() -> None:
    register_slow_backend()
    script, configs = sys.argv[1], json.loads(sys.argv[2])
    module = load_script(script)
    for i, config in enumerate(configs):
        os.environ["MASTER_PORT"] = str(config["port"])
        if os.environ["RANK"] == "0":
            print(f"### config {i}", flush=True)
        try:
            module.main(module.parse_args(config["args"]))
            dist.destroy_process_group()
            torch._dynamo.reset()  # a new model next: compile it afresh, not as a recompile
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            sys.stdout.flush()
            os._exit(1)
    sys.stdout.flush()
    os._exit(0)  # like the scripts' run_rank: no interpreter teardown with threads alive


if __name__ == "__main__":
    main()
