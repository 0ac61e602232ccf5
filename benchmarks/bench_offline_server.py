"""The cost of pytrio's real client: the book's GRPO loop through the loopback server vs the in-process backend.

Usage::

    python benchmarks/bench_offline_server.py                 # 4 sync steps, batch 4 x group 4, 3 rounds
    python benchmarks/bench_offline_server.py --rollout async --steps 4 --rounds 5

Both arms run ``trio_helpers.grpo.run_grpo`` with the same config and seed, without simulated latency: arm
"in-process" on ``connect("offline", latency=0, in_process=True)`` (the offline backend's own client classes), arm
"server" on pytrio's ``ServiceClient`` against ``trio_helpers.offline.server`` over 127.0.0.1 (pytrio's transport,
its event protocol, msgpack and JSON, long polls). It checks that both give the same metrics (wall-clock keys left
out) and the same final weights, then prints the median wall time and CPU time of each arm over ``--rounds`` rounds
(arms alternate, and every other round runs them in reverse order), their ratios and the extra milliseconds per
step, the ledger's requests per server run and the HTTP requests pytrio sent for them, by kind. The CPU time is this
process's (client, server and compute threads alike): it is what a chapter's kernel would spend (issue 23).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trio_helpers import connect  # noqa: E402
from trio_helpers.data import load_gsm8k  # noqa: E402
from trio_helpers.grpo import GRPOConfig, run_grpo  # noqa: E402
from trio_helpers.offline import server as offline_server  # noqa: E402
from trio_helpers.offline.server import OfflineServer, service_client  # noqa: E402
from trio_helpers.offline.service import OfflineOptions  # noqa: E402


def comparable(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in history]


def run(arm: str, config: GRPOConfig, records, server: OfflineServer, home: Path):
    service = (connect("offline", latency=0.0, home=home, in_process=True) if arm == "in-process"
               else service_client(server, retry_initial_delay_seconds=0.05))
    started, cpu = time.perf_counter(), time.process_time()
    result = run_grpo(service, records, config, progress=False, print_every=0)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    tc = result.training_client
    state = server._runs[tc._training_run_cuid].state if arm == "server" else tc
    weights = [v.tobytes() for v in state._model.adapter.params().values()]
    return (seconds, cpu), comparable(result.history), weights


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rollout", default="sync", choices=("sync", "async", "pipeline"))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    home = Path(tempfile.mkdtemp(prefix="bench-offline-server-"))
    server = OfflineServer(options=OfflineOptions(latency=0.0, home=home)).start()
    config = GRPOConfig(steps=args.steps, batch_size=4, group_size=4, max_tokens=96, rollout=args.rollout,
                        weights_name=None)
    records = load_gsm8k("train", source="offline")
    times: dict[str, list[float]] = {"in-process": [], "server": []}
    cpus: dict[str, list[float]] = {"in-process": [], "server": []}
    http: collections.Counter = collections.Counter()
    handle = offline_server._Handler._handle

    def counted(self, method):  # the HTTP requests pytrio sends, by kind (ids left out)
        http[f"{method} {re.sub(r'(event_|srun-|trun-|session-)[A-Za-z0-9_-]+', '{id}', self.path)}"] += 1
        return handle(self, method)

    offline_server._Handler._handle = counted
    reference = None
    for r in range(args.rounds):
        arms = ("in-process", "server") if r % 2 == 0 else ("server", "in-process")
        for arm in arms:
            before = server.usage().requests
            http.clear()
            (seconds, cpu), history, weights = run(arm, config, records, server, home)
            times[arm].append(seconds)
            cpus[arm].append(cpu)
            if reference is None:
                reference = (history, weights)
            assert (history, weights) == reference, f"{arm} differs in round {r}"
            if arm == "server":
                requests, sent = server.usage().requests - before, dict(http)
    a, b = statistics.median(times["in-process"]), statistics.median(times["server"])
    print({k: [round(t, 2) for t in v] for k, v in times.items()})
    print(f"GRPO {args.rollout}, {args.steps} steps, batch 4 x group 4, max_tokens 96; {args.rounds} rounds")
    print("same metrics and final weights in every run: yes")
    print(f"wall: in-process {a:.2f} s   server {b:.2f} s   ratio {b / a:.2f}   "
          f"difference {(b - a) / args.steps * 1000:.0f} ms/step")
    a, b = statistics.median(cpus["in-process"]), statistics.median(cpus["server"])
    print(f"CPU:  in-process {a:.2f} s   server {b:.2f} s   ratio {b / a:.2f}   "
          f"difference {(b - a) / args.steps * 1000:.0f} ms/step")
    print(f"a server run: {requests} requests in the ledger, {sum(sent.values())} HTTP requests from pytrio:")
    for what, n in sorted(sent.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {what}")


if __name__ == "__main__":
    main()
