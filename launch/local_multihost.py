"""Several local processes joined into one global mesh (CPU collectives), for testing
multi-host behaviour on one machine:

    python -m launch.local_multihost --num_processes=2 --devices_per_process=4 -- <train flags>
"""

import socket
import sys

from absl import app, flags

from jaxscale.lofi.local import run_prefixed

_N = flags.DEFINE_integer("num_processes", 2, "Processes to start.")
_DEV = flags.DEFINE_integer("devices_per_process", 4, "Simulated CPU devices per process.")
_MODULE = flags.DEFINE_string("module", "launch.train", "Entry point every process runs.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def main(argv):
    address = f"localhost:{_free_port()}"
    commands = {f"p{i}": [sys.executable, "-m", _MODULE.value, *argv[1:],
                          f"--coordinator_address={address}",
                          f"--num_processes={_N.value}", f"--process_id={i}",
                          f"--cpu_devices={_DEV.value}"] for i in range(_N.value)}
    raise SystemExit(run_prefixed(commands))


if __name__ == "__main__":
    app.run(main)
