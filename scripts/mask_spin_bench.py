"""`offline-paged` with offline_paged.core.mask_server.SPIN_S set first (the session 49 experiment: the mask
workers and the step loop poll their sockets for up to SPIN_S seconds before they block).

    python3 scripts/mask_spin_bench.py SECONDS bench --structured json ...
    e.g. in a device call: BENCH="python3 scripts/mask_spin_bench.py 0.003" scripts/device_structured.sh
"""
import sys

from offline_paged.core import mask_server

mask_server.SPIN_S = float(sys.argv[1])
from offline_paged.cli.main import cli  # noqa: E402  (after the knob: the server reads it when it starts)

cli(sys.argv[2:], prog_name="offline-paged")
