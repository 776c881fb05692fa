"""Measure the sidecar's idle footprint: RSS and CPU with all three cloud pollers on.

Not a test (timings are never assertions): run it by hand and copy the figures into
``docs/sidecar.md``::

    .venv/bin/python tests/sidecar/footprint.py --seconds 60

It starts the real ``baton-sidecar`` with ``--cloud auto`` against the three fake metadata
servers (so AWS polls every 5 s, Azure every 1 s, GCE long-polls both keys), with the default
intervals, a trainer heartbeat every 5 s and a Prometheus-style scrape every 15 s, then reads
``/proc/<pid>`` for resident memory and CPU time.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from baton_testing.fake_clouds import FakeAws, FakeAzure, FakeGce
from baton_testing.sidecar_process import SidecarProcess

from trainer_sdk.control import ControlChannel, Status


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory() as tmp,
        FakeAws() as aws,
        FakeGce() as gce,
        FakeAzure() as azure,
    ):
        sc = SidecarProcess(
            Path(tmp),
            cloud="auto",
            env={
                "BATON_AWS_IMDS_ENDPOINT": aws.url,
                "BATON_GCE_METADATA_ENDPOINT": gce.url,
                "BATON_AZURE_IMDS_ENDPOINT": azure.url,
                "BATON_SIDECAR_STATUS_INTERVAL": "0.5",
                "BATON_SIDECAR_LOG_LEVEL": "INFO",
            },
        ).start()
        assert sc.proc is not None
        pid = sc.proc.pid
        channel = ControlChannel(sc.control_dir)
        status = Status()
        time.sleep(5)  # detection and first polls
        cpu0, t0 = _cpu_seconds(pid), time.monotonic()
        peak = 0
        next_beat = next_scrape = t0
        while time.monotonic() - t0 < args.seconds:
            now = time.monotonic()
            if now >= next_beat:
                status = status.beat()
                channel.write_status(status)
                next_beat = now + 5
            if now >= next_scrape:
                sc.metrics()
                next_scrape = now + 15
            peak = max(peak, _rss_kib(pid))
            time.sleep(0.5)
        cpu1, t1 = _cpu_seconds(pid), time.monotonic()
        rss = _rss_kib(pid)
        polls = (
            aws.count("GET", "/spot/instance-action"),
            gce.count("GET", "/preempted") + gce.count("GET", "/maintenance-event"),
            azure.count("GET", "/scheduledevents"),
        )
        assert sc.stop() == 0
    print(f"window: {t1 - t0:.0f} s, polls aws/gce/azure: {polls}")
    print(f"RSS: {rss / 1024:.1f} MiB (peak {peak / 1024:.1f} MiB)")
    print(f"CPU: {cpu1 - cpu0:.2f} s = {100 * (cpu1 - cpu0) / (t1 - t0):.2f}% of one core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
