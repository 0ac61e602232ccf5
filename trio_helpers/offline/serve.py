"""Run the offline PyTRIO-compatible server standalone: ``python -m trio_helpers.offline.serve``.

It prints the environment an unmodified pytrio program needs (one ``export`` line each), then serves on 127.0.0.1
until interrupted::

    python -m trio_helpers.offline.serve --port 8765 --seed 0
    # in another shell: paste the export lines, then
    python my_pytrio_script.py

pytrio reads ``PYTRIO_API_KEY``, ``PYTRIO_BASE_URL`` and ``HOME`` when it is imported; ``HOME`` points at a private
directory so that nothing under ``~/.pytrio`` is read or written. ``MODELSCOPE_CACHE`` serves the offline tokenizer
to ``get_tokenizer()``, and ``MODELSCOPE_ENDPOINT`` sends a miss to a dead 127.0.0.1 port, never the internet.
Introduced in: book/offline_backend.md.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import tempfile
from pathlib import Path

from trio_helpers.offline.server import OFFLINE_API_KEY, OfflineServer, tokenizer_environment
from trio_helpers.offline.service import OfflineOptions, default_home


def environment(server: OfflineServer, home: Path) -> dict[str, str]:
    """The variables a pytrio program needs to use ``server``. pytrio has no variable that turns telemetry off; a
    program's telemetry goes to this server (which drops it) and buffers under the private ``HOME``."""
    return {"PYTRIO_API_KEY": OFFLINE_API_KEY, "PYTRIO_BASE_URL": server.base_url, "HOME": str(home),
            **tokenizer_environment(home / "modelscope")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trio_helpers.offline.serve", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1 (default: a free one)")
    parser.add_argument("--latency", type=float, default=0.0,
                        help="seconds each request waits: runs created, training events and samples, not "
                             "pytrio's own session, poll or heartbeat requests (default 0)")
    parser.add_argument("--fault-rate", type=float, default=0.0,
                        help="probability that an attempt of such a request is answered HTTP 503 (pytrio retries it)")
    parser.add_argument("--outage-after", type=int, default=None,
                        help="answer 503 to everything from this request on (0-based; requests are numbered as the "
                             "ledger counts them: runs created, training events and samples, not pytrio's own "
                             "session, init_run, renewal, poll or heartbeat requests)")
    parser.add_argument("--seed", type=int, default=0, help="seeds faults and the default sampling seeds")
    parser.add_argument("--home", type=Path, default=None,
                        help="checkpoint directory (default: $TRIO_OFFLINE_HOME or ~/.cache/trio_helpers)")
    args = parser.parse_args(argv)
    options = OfflineOptions(latency=args.latency, fault_rate=args.fault_rate, outage_after=args.outage_after,
                             seed=args.seed, home=args.home or default_home())
    server = OfflineServer(port=args.port, options=options)
    client_home = Path(tempfile.mkdtemp(prefix="trio-offline-client-"))
    for name, value in environment(server, client_home).items():
        print(f"export {name}={shlex.quote(value)}")
    print(f"# serving pytrio's protocol on {server.base_url} (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        print(f"# served: {server.usage().requests} requests; faults {dict(server.stats)}", file=sys.stderr)


if __name__ == "__main__":
    main()
