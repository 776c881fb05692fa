"""Replication of memory-tier snapshots between real ``baton-sidecar`` processes.

A snapshot (real format v1 files written by ``trainer_sdk.save``) in one sidecar's
``fast_dir`` is copied to a peer on the SDK's request (the control-directory hand-off of
``trainer_sdk.replication``), verified file by file, manifest last; the receiver keeps the
newest complete replica only; a replica cut short (a sender SIGKILLed mid-file, a receiver
SIGKILLed mid-transfer), a corrupt chunk, a manifest before its files and a request without
the token are refused and never listed or used; ``fill`` completes a pod's missing files from
a peer, verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from baton_testing.sidecar_process import TOKEN, SidecarProcess, wait_for

import trainer_sdk
from trainer_sdk.replication import BELL_FILE, FILL, REPLICATE, SidecarLink, ring_bell

SOURCE = "w1-r0"


def _step(step: int) -> str:
    return f"step-{step:012d}"


def _snapshot(fast: Path, step: int, numel: int = 1 << 16) -> None:
    gen = torch.Generator().manual_seed(step)
    state = {"w": torch.randn(numel, generator=gen), "b": torch.randn(7, generator=gen)}
    trainer_sdk.save(state, str(fast), step=step)


def _digest(manifest: dict[str, Any], name: str) -> str:
    """The X-Baton-Digest value of a file: the digest the manifest records for it."""
    entry = manifest["files"][name]
    algorithm = next(a for a in ("xxh3_128", "blake3", "sha256") if a in entry)
    return f"{algorithm}={entry[algorithm]}"


def _files(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


@pytest.fixture
def pods(tmp_path: Path) -> Iterator[Callable[..., list[SidecarProcess]]]:
    """Start N sidecars, each with its own fast_dir and failure domain, peers in ring order."""
    started: list[SidecarProcess] = []

    def make(n: int, **env: str) -> list[SidecarProcess]:
        procs = []
        for i in range(n):
            sub = tmp_path / f"pod{len(started) + i}"
            sub.mkdir()
            procs.append(SidecarProcess(sub))
        for i, p in enumerate(procs):
            ring = procs[i + 1 :] + procs[:i]
            p.env.update(
                {
                    "BATON_FAST_DIR": str(p.tmp / "fast"),
                    "BATON_FAILURE_DOMAIN": f"node-{i}",
                    "BATON_REPLICATION_PEERS": json.dumps(
                        [{"address": q.url, "domain": f"node-{procs.index(q)}"} for q in ring]
                    ),
                    **env,
                }
            )
        started.extend(procs)
        for p in procs:
            p.start()
        return procs

    yield make
    for p in started:
        p.stop()
        assert TOKEN not in p.log(), "the bearer token appeared in the sidecar's log"


def _fast(p: SidecarProcess) -> Path:
    return p.tmp / "fast"


def _replication(p: SidecarProcess) -> dict[str, object]:
    r = p.status()
    assert r.status_code == 200, r.text
    value = r.json()["replication"]
    assert isinstance(value, dict)
    return value


def _connected_to(port: int) -> bool:
    """Whether some local socket has an established connection to ``port``."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[2].endswith(f":{port:04X}") and fields[3] == "01":
                    return True
    return False


def _put(p: SidecarProcess, path: str, data: bytes, **headers: str) -> requests.Response:
    return requests.put(f"{p.url}{path}", data=data, headers=headers, timeout=30)


def test_a_snapshot_is_replicated_verified_and_only_the_newest_is_kept(
    pods: Callable[..., list[SidecarProcess]],
) -> None:
    a, b = pods(2)
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the sidecar's replication advert")
    _snapshot(_fast(a), 3)
    answer = link.call(REPLICATE, step=3, timeout=60)
    assert answer.ok, answer
    assert answer.peers == (b.url,)
    held = _fast(b) / "replicas" / SOURCE / _step(3)
    # byte for byte what a holds, manifest included
    assert _files(held) == _files(_fast(a) / _step(3))
    assert answer.bytes == sum((held / n).stat().st_size for n in os.listdir(held))

    _snapshot(_fast(a), 4)
    answer4 = link.call(REPLICATE, step=4, timeout=60)
    assert answer4.ok, answer4
    assert sorted(os.listdir(_fast(b) / "replicas" / SOURCE)) == [_step(4)]
    st = _replication(a)
    assert st["last_replicated_step"] == 4
    assert st["failures"] == 0
    assert st["bytes_sent"] == answer.bytes + answer4.bytes
    peers = st["peers"]
    assert isinstance(peers, list)
    assert peers[0]["address"] == b.url
    assert peers[0]["last_step"] == 4
    held_b = _replication(b)["held"]
    assert held_b == [{"source": SOURCE, "step": 4, "complete": True}]
    assert "baton_replication_last_step 4.0" in a.metrics()
    assert 'baton_replication_bytes_total{direction="received"}' in b.metrics()
    # b lists the replica in its catalog (authenticated), a lists its own snapshot
    r = requests.get(f"{b.url}/v1/replicas", headers=b.headers(), timeout=10)
    assert r.status_code == 200, r.text
    [item] = r.json()["holdings"]
    assert (item["source"], item["step"]) == (SOURCE, 4)
    assert set(item["files"]) == set(item["digests"])


def test_requests_are_taken_on_the_bell_with_the_poll_an_hour_away(
    pods: Callable[..., list[SidecarProcess]],
) -> None:
    """The SDK rings ``replication.bell`` after each request; the sidecar's looks between
    bells are set an hour apart here, so only the bell can get the requests answered."""
    a, b = pods(2, BATON_REPLICATION_POLL_INTERVAL="3600")
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the sidecar's replication advert")
    bell = a.control_dir / BELL_FILE
    assert stat.S_ISFIFO(bell.stat().st_mode)
    assert stat.S_IMODE(bell.stat().st_mode) == 0o622  # the trainer may be another user
    for step in (3, 4, 5):
        _snapshot(_fast(a), step)
        answer = link.call(REPLICATE, step=step, timeout=60)
        assert answer.ok, answer
        assert answer.step == step
    assert sorted(os.listdir(_fast(b) / "replicas" / SOURCE)) == [_step(5)]
    assert _replication(a)["last_replicated_step"] == 5
    assert a.stop() == 0
    assert not bell.exists()
    assert not ring_bell(a.control_dir)


def test_ring_bell_wakes_only_a_listening_fifo(tmp_path: Path) -> None:
    """No FIFO, a FIFO nobody reads, or a regular file in its place: False, nothing written,
    nothing blocks. A FIFO with a reader gets a byte."""
    assert not ring_bell(tmp_path)
    bell = tmp_path / BELL_FILE
    bell.write_bytes(b"keep")
    assert not ring_bell(tmp_path)
    assert bell.read_bytes() == b"keep"
    bell.unlink()
    os.mkfifo(bell)
    assert not ring_bell(tmp_path)  # ENXIO: no reader
    reader = os.open(bell, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert ring_bell(tmp_path)
        assert ring_bell(tmp_path)
        assert os.read(reader, 16) == b"\n\n"
    finally:
        os.close(reader)


def test_a_replica_overwrites_the_files_of_the_one_before_last_and_arrives_whole(
    pods: Callable[..., list[SidecarProcess]],
) -> None:
    """The receiver writes each replica into the files of the replica before the last (on
    tmpfs a new file costs 4x the CPU), grown or cut to the new size; the sender sends the
    files with sendfile(2). Every replica is byte for byte the snapshot."""
    a, b = pods(2)
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the sidecar's replication advert")
    replicas = _fast(b) / "replicas" / SOURCE
    inodes: dict[int, int] = {}
    # over 1 MiB each (spares are only kept from there); step 5 larger, step 6 smaller
    sizes = {3: 1 << 19, 4: 1 << 19, 5: (1 << 19) + 4099, 6: (1 << 18) + 3}
    for step, numel in sizes.items():
        _snapshot(_fast(a), step, numel=numel)
        answer = link.call(REPLICATE, step=step, timeout=60)
        assert answer.ok, answer
        held = replicas / _step(step)
        assert _files(held) == _files(_fast(a) / _step(step))
        [shard] = [n for n in os.listdir(held) if n.endswith(".safetensors")]
        inodes[step] = (held / shard).stat().st_ino
        assert sorted(os.listdir(replicas)) == [_step(step)], "only the newest is kept"
    assert inodes[5] == inodes[3]
    assert inodes[6] == inodes[4]
    assert inodes[4] != inodes[3]
    # the spares are never listed, served or counted as a replica
    assert _replication(b)["held"] == [{"source": SOURCE, "step": 6, "complete": True}]
    r = requests.get(f"{b.url}/v1/replicas", headers=b.headers(), timeout=10)
    assert [(h["source"], h["step"]) for h in r.json()["holdings"]] == [(SOURCE, 6)]


def test_fill_completes_a_replaced_pod_from_its_peer_verified(
    pods: Callable[..., list[SidecarProcess]], tmp_path: Path
) -> None:
    a, b = pods(2)
    _snapshot(_fast(a), 5)
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the advert")
    assert link.call(REPLICATE, step=5, timeout=60).ok
    want = _files(_fast(a) / _step(5))
    # pod a is lost: a new sidecar with an empty memory tier, the same ranks
    a.stop()
    c = SidecarProcess(tmp_path / "replacement-a-dir-not-a-pod-name", env=dict(a.env))
    (c.tmp).mkdir(exist_ok=True)
    c.env["BATON_FAST_DIR"] = str(tmp_path / "replacement-fast")
    c.env["BATON_CONTROL_DIR"] = str(c.control_dir)
    c.env["BATON_SIDECAR_PORT"] = str(c.port)
    c.env["BATON_SIDECAR_TOKEN_FILE"] = str(c.token_file)
    c.start()
    try:
        new = SidecarLink(c.control_dir)
        wait_for(new.available, what="the new sidecar's advert")
        answer = new.call(FILL, step=None, timeout=60)
        assert answer.ok, answer
        assert answer.step == 5
        assert _files(tmp_path / "replacement-fast" / _step(5)) == want
        assert trainer_sdk.list_steps(str(tmp_path / "replacement-fast")) == [5]
        fill = _replication(c)["last_fill"]
        assert isinstance(fill, dict)
        assert fill["step"] == 5
        assert fill["error"] is None
        # A corrupt replica is never used: flip a byte in b's copy, fill a fresh dir again.
        shard = _fast(b) / "replicas" / SOURCE / _step(5) / "rank-00000-of-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        (tmp_path / "replacement-fast" / _step(5) / "rank-00000-of-00001.safetensors").unlink()
        (tmp_path / "replacement-fast" / _step(5) / "manifest.json").unlink()
        answer = new.call(FILL, step=None, timeout=60)
        assert not answer.ok
        assert "step 5" in (answer.error or ""), answer
        assert not (tmp_path / "replacement-fast" / _step(5) / "manifest.json").exists()
        assert trainer_sdk.list_steps(str(tmp_path / "replacement-fast")) == []
    finally:
        c.stop()


def test_refused_uploads_leave_nothing_usable(pods: Callable[..., list[SidecarProcess]]) -> None:
    a, b = pods(2)
    _snapshot(_fast(a), 7)
    src = _fast(a) / _step(7)
    manifest = json.loads((src / "manifest.json").read_text())
    name = "rank-00000-of-00001.safetensors"
    data = (src / name).read_bytes()
    digest = _digest(manifest, name)
    path = f"/v1/replicas/{SOURCE}/7/{name}"

    # no token, a wrong token: refused before a byte is stored
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = _put(b, path, data, **{"X-Baton-Digest": digest}, **headers)
        assert r.status_code == 401, r.text
    assert requests.get(f"{b.url}/v1/replicas", timeout=10).status_code == 401
    assert requests.get(f"{b.url}/v1/replicas/{SOURCE}/7/{name}", timeout=10).status_code == 401
    r = requests.put(f"{b.url}/v1/replication/peers", json={"peers": []}, timeout=10)
    assert r.status_code == 401
    assert not (_fast(b) / "replicas" / SOURCE).exists()

    # a corrupt chunk: one flipped bit fails the manifest's digest; nothing is kept
    bad = bytearray(data)
    bad[len(bad) // 3] ^= 0x10
    r = _put(b, path, bytes(bad), **b.headers(), **{"X-Baton-Digest": digest})
    assert r.status_code == 422, r.text
    assert "refused" in r.json()["error"]
    assert os.listdir(_fast(b) / "replicas" / SOURCE / _step(7)) == []
    assert 'baton_replication_failures_total{op="receive"} 1.0' in b.metrics()

    # the manifest before its files: refused, so a replica without its files is never complete
    r = _put(b, f"/v1/replicas/{SOURCE}/7/manifest.json", (src / "manifest.json").read_bytes(),
             **b.headers())  # fmt: skip
    assert r.status_code == 409, r.text
    # a file of a rank the source does not have, a bad source key, a path escape
    for bad_path in (
        "/v1/replicas/w1-r0/7/rank-00001-of-00002.json",
        f"/v1/replicas/pod-a/7/{name}",
        f"/v1/replicas/{SOURCE}/7/..%2Fmanifest.json",
    ):
        r = _put(b, bad_path, b"x", **b.headers(), **{"X-Baton-Digest": digest})
        assert r.status_code in (400, 404), (bad_path, r.status_code, r.text)
    r = requests.get(f"{b.url}/v1/replicas", headers=b.headers(), timeout=10)
    assert r.json()["holdings"] == []
    r = requests.get(f"{b.url}/v1/replicas/{SOURCE}/7/{name}", headers=b.headers(), timeout=10)
    assert r.status_code == 404


def test_a_sender_killed_mid_file_leaves_no_usable_replica(
    pods: Callable[..., list[SidecarProcess]], tmp_path: Path
) -> None:
    a, b = pods(2)
    _snapshot(_fast(a), 9, numel=1 << 20)
    src = _fast(a) / _step(9)
    manifest = json.loads((src / "manifest.json").read_text())
    # The json file arrives whole; then a real sender process streams half of the shard and
    # is SIGKILLed by itself mid-body (the kernel closes its socket).
    json_name = "rank-00000-of-00001.json"
    headers = {**b.headers(), "X-Baton-Digest": _digest(manifest, json_name)}
    r = _put(b, f"/v1/replicas/{SOURCE}/9/{json_name}", (src / json_name).read_bytes(), **headers)
    assert r.status_code == 200, r.text
    shard = "rank-00000-of-00001.safetensors"
    sender = textwrap.dedent(
        f"""
        import os, signal, socket
        data = open({str(src / shard)!r}, "rb").read()
        s = socket.create_connection(("127.0.0.1", {b.port}))
        head = (
            "PUT /v1/replicas/{SOURCE}/9/{shard} HTTP/1.1\\r\\nHost: x\\r\\n"
            "Authorization: Bearer {TOKEN}\\r\\n"
            "X-Baton-Digest: {_digest(manifest, shard)}\\r\\n"
            f"Content-Length: {{len(data)}}\\r\\n\\r\\n"
        )
        s.sendall(head.encode() + data[: len(data) // 2])
        print("half sent", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", sender], check=False, capture_output=True, timeout=60
    )
    assert proc.returncode == -signal.SIGKILL, proc
    assert b"half sent" in proc.stdout
    held = _fast(b) / "replicas" / SOURCE / _step(9)
    # Not "until no .part file": that holds before the receiver has even begun the body. The
    # receiver counts the broken-off body as a failed receive once it has dropped the part.
    wait_for(
        lambda: 'baton_replication_failures_total{op="receive"} 1.0' in b.metrics(),
        what="the receiver to refuse the broken-off body",
    )
    assert sorted(os.listdir(held)) == [json_name]
    # the manifest cannot complete it, the catalog does not list it, a fill does not use it
    r = _put(b, f"/v1/replicas/{SOURCE}/9/manifest.json", (src / "manifest.json").read_bytes(),
             **b.headers())  # fmt: skip
    assert r.status_code == 409, r.text
    r = requests.get(f"{b.url}/v1/replicas", headers=b.headers(), timeout=10)
    assert r.json()["holdings"] == []
    (src / shard).unlink()  # a's own copy is gone too: only a complete replica could help
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the advert")
    (src / "manifest.json").unlink()
    answer = link.call(FILL, step=None, timeout=60)
    assert answer.step is None, answer  # nothing complete anywhere: nothing filled
    assert trainer_sdk.list_steps(str(_fast(a))) == []


def test_a_receiver_killed_mid_transfer_fails_the_copy_and_keeps_nothing(
    pods: Callable[..., list[SidecarProcess]], tmp_path: Path
) -> None:
    a, b = pods(2, BATON_REPLICATION_TIMEOUT="5")
    _snapshot(_fast(a), 11, numel=1 << 22)  # 16 MiB: more than the sockets' buffers hold
    link = SidecarLink(a.control_dir)
    wait_for(link.available, what="the advert")
    assert b.proc is not None
    os.kill(b.proc.pid, signal.SIGSTOP)  # accepts (the kernel does) but never reads
    try:
        import threading

        answers = []
        t = threading.Thread(
            target=lambda: answers.append(link.call(REPLICATE, step=11, timeout=120))
        )
        t.start()
        # the copy has begun: a's sidecar is connected to b (which never answers)
        wait_for(lambda: _connected_to(b.port), what="a's sidecar to connect to b")
    finally:
        os.kill(b.proc.pid, signal.SIGKILL)
        b.proc.wait()
    t.join(120)
    [answer] = answers
    assert not answer.ok
    assert b.url in (answer.error or ""), answer
    st = _replication(a)
    assert st["failures"] == 1
    assert b.url in str(st["last_error"])
    assert 'baton_replication_failures_total{op="replicate"} 1.0' in a.metrics()
    # a's own snapshot is untouched
    assert trainer_sdk.list_steps(str(_fast(a))) == [11]
    # a new sidecar on b's memory finds no complete replica and serves none
    again = SidecarProcess(b.tmp, env=dict(b.env))
    again.env["BATON_SIDECAR_PORT"] = str(again.port)
    again.start()
    try:
        r = requests.get(f"{again.url}/v1/replicas", headers=again.headers(), timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["holdings"] == []
    finally:
        again.stop()


def test_peers_can_be_set_over_http_and_bad_ones_are_refused(
    pods: Callable[..., list[SidecarProcess]],
) -> None:
    [a] = pods(1)
    r = requests.put(
        f"{a.url}/v1/replication/peers",
        json={"peers": [{"address": "http://127.0.0.9:1234", "domain": "zone-b"}], "replicas": 2},
        headers=a.headers(),
        timeout=10,
    )
    assert r.status_code == 200, r.text
    st = _replication(a)
    assert st["replicas"] == 2
    assert st["peers"] == [{"address": "http://127.0.0.9:1234", "domain": "zone-b"}]
    for body in (
        {"peers": [{"address": "ftp://x:1"}]},
        {"peers": [{"address": "http://x:1/path"}]},
        {"peers": "http://x:1"},
        {"peers": [], "replicas": 0},
        {"peer": []},
    ):
        r = requests.put(
            f"{a.url}/v1/replication/peers", json=body, headers=a.headers(), timeout=10
        )
        assert r.status_code == 400, (body, r.text)
        assert "error" in r.json()
    # with no peer of another domain reachable, a copy fails and says so
    _snapshot(_fast(a), 1)
    link = SidecarLink(a.control_dir)
    answer = link.call(REPLICATE, step=1, timeout=60)
    assert not answer.ok
    assert "0 of 2 replicas" in (answer.error or ""), answer


def _train_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _weights(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[bytes]:
    out = [t.detach().numpy().tobytes() for t in model.state_dict().values()]
    for st in opt.state_dict()["state"].values():
        out += [v.numpy().tobytes() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


def test_the_checkpointer_replicates_each_snapshot_and_a_replaced_pod_restores_from_it(
    pods: Callable[..., list[SidecarProcess]], tmp_path: Path
) -> None:
    """The SDK's side for real: every snapshot is copied before the older one is deleted,
    and a pod whose memory is gone restores the newest snapshot from its peer, bitwise."""
    a, b = pods(2)
    wait_for(SidecarLink(a.control_dir).available, what="the advert")
    model, opt = _train_state(0)
    with trainer_sdk.Checkpointer(
        tmp_path / "ck", model=model, optimizer=opt, every_steps=100, fast_every_steps=1,
        fast_dir=_fast(a), control_dir=str(a.control_dir), handle_sigterm=False,
    ) as ck:  # fmt: skip
        assert ck.restore() == 0
        for step in range(1, 6):
            _train_step(model, opt, step)
            ck.step(step)
            ck.wait()
            # the write (ck.wait) ends once the copy has: the peer holds exactly this one
            assert sorted(os.listdir(_fast(b) / "replicas" / SOURCE)) == [_step(step)]
            assert _replication(a)["last_replicated_step"] == step
    want = _weights(model, opt)
    assert trainer_sdk.list_steps(str(tmp_path / "ck")) == []  # only the memory tier has it

    # The pod is replaced: a new sidecar (new address) on an empty memory tier.
    c = SidecarProcess(tmp_path / "pod-replacement")
    c.env.update(
        {
            "BATON_FAST_DIR": str(_fast(c)),
            "BATON_FAILURE_DOMAIN": "node-9",
            "BATON_REPLICATION_PEERS": json.dumps([{"address": b.url, "domain": "node-1"}]),
        }
    )
    c.start()
    try:
        wait_for(SidecarLink(c.control_dir).available, what="the new advert")
        model2, opt2 = _train_state(1)
        with trainer_sdk.Checkpointer(
            tmp_path / "ck", model=model2, optimizer=opt2, fast_dir=_fast(c),
            control_dir=str(c.control_dir), handle_sigterm=False,
        ) as ck2:  # fmt: skip
            assert ck2.restore() == 5
            assert ck2.restored.tier == "memory"
        assert _weights(model2, opt2) == want
        fill = _replication(c)["last_fill"]
        assert isinstance(fill, dict)
        assert fill["step"] == 5
    finally:
        c.stop()
