"""The gang path's rendezvous: ranks 1..n start with rank 0's DNS name as ``MASTER_ADDR``
before that name resolves (every rank of a gang is created at once, before rank 0 has an IP).

What torch 2.13's TCPStore client does with such a name, checked here with a real late name:
it does not fail, it retries the lookup (c10d ``socket.cpp`` logs "The IPv6 network addresses
of (...) cannot be retrieved (gai error: -2 ...)") with a backoff until its timeout, as it
retries a refused connection, and connects once the name resolves. torchrun's static
rendezvous (the ``PET_MASTER_ADDR`` the operator sets) builds the same TCPStore client on
every node but rank 0, so it waits the same way. The SDK therefore adds no wait of its own.

The late name is made in a private mount namespace (``unshare -m``): the client's
``/etc/hosts`` is a file this test writes the name into only after the client has been seen
failing to resolve it. glibc reads ``/etc/hosts`` afresh at each lookup.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import threading
from pathlib import Path

from baton_testing.ports import free_port
from baton_testing.sidecar_process import wait_for
from torch.distributed import TCPStore

LATE_NAME = "tj-a0-r0.tj.team.svc.cluster.local"
"""A gang's rank 0 name as the operator writes it (manifests.master_dns_name)."""

CLIENT = """
import datetime, sys
from torch.distributed import TCPStore
host, port = sys.argv[1], int(sys.argv[2])
# is_master=False: a rank other than 0, as in init_process_group's env:// rendezvous.
store = TCPStore(host, port, 2, False, timeout=datetime.timedelta(seconds=300))
print("got", store.get("from-rank-0").decode(), flush=True)
"""


def test_a_tcpstore_client_waits_for_a_master_name_that_resolves_late(tmp_path: Path) -> None:
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed to give the client its own hosts"
    hosts = tmp_path / "hosts"
    hosts.write_text(Path("/etc/hosts").read_text())
    assert LATE_NAME not in hosts.read_text()
    port = free_port()
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    # The bind mount lives only in the client's own mount namespace; the host's file is
    # never touched.
    shell = 'mount --make-rprivate / && mount --bind "$1" /etc/hosts && shift && exec "$@"'
    client = subprocess.Popen(
        [unshare, "-m", "sh", "-c", shell, "sh", str(hosts),
         sys.executable, str(script), LATE_NAME, str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(iter(client.stderr.readline, "")))  # type: ignore[union-attr]
    reader.start()
    server = None
    try:
        # The client is up and its lookups fail: the name does not resolve yet.
        wait_for(
            lambda: (
                any("cannot be retrieved" in line and LATE_NAME in line for line in err)
                or client.poll() is not None
            ),
            timeout=120,
            what="the TCPStore client to try the name that does not resolve yet",
        )
        assert client.poll() is None, f"the client gave up on an unresolved name: {''.join(err)}"
        server = TCPStore(
            "127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=300),
            wait_for_workers=False,
        )  # fmt: skip
        server.set("from-rank-0", "hello")
        with hosts.open("a") as f:  # in place: the bind mount shows the same inode
            f.write(f"127.0.0.1 {LATE_NAME}\n")
        out, _ = client.communicate(timeout=240)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        reader.join(timeout=30)
        for stream in (client.stdout, client.stderr):
            if stream is not None:
                stream.close()
        del server
    assert client.returncode == 0, "".join(err)[-4000:]
    assert out.strip() == "got hello"
