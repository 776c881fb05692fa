"""Kueue's controller manager, run against the session's local cluster.

``tools/kueue/build.sh`` builds Kueue (the version pinned in ``tools/kueue/go.mod``) and copies
its CRDs and webhook configurations out of the same Go module. :func:`running_kueue` installs
them, starts the manager as a host process and waits until its webhooks answer; on the way out
it stops the manager (no process left) and removes every cluster-wide thing it added, first of
all the webhook configurations: a ``failurePolicy: Fail`` webhook left pointing at a stopped
server would reject the Kueue objects and pods of every later test of the session.

How it fits the local cluster (pods are host processes, no Service routing):

* The API server reaches the webhooks (admission and CRD conversion) through
  ``clientConfig.url`` ``https://127.0.0.1:<port>/...``, not a Service.
* Kueue's internal certificate management stays on (without it the manager insists on metrics
  certificates in a fixed ``/etc/kueue/metrics/certs``), but it finds a Secret made here: a CA
  and a serving certificate for both its Service name and ``127.0.0.1``. Kueue keeps a valid
  certificate it finds, injects the CA into the webhook configurations and CRDs, and serves
  the same certificate, which this module also writes into its ``certDir`` (in a real cluster
  the Secret is a mounted volume).
* Only the plain-pod integration is on, and its webhooks and ``managedJobsNamespaceSelector``
  select one namespace (the test's), so Kueue never sees another test's pods. Of the webhook
  configurations only Kueue's own kinds and pods are installed (no Jobs, Deployments, ...).
* Leader election, the metrics server and the visibility API server are off; the health
  probes bind a free port on 127.0.0.1.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import datetime
import ipaddress
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import yaml
from baton_testing.cluster import LocalCluster
from baton_testing.ports import free_port
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["KUEUE_BUILD", "Kueue", "kueue_build", "running_kueue"]

REPO: Final = Path(__file__).resolve().parents[2]
KUEUE_BUILD: Final = REPO / "tools" / "kueue" / "build.sh"
KUEUE_NAMESPACE: Final = "kueue-system"
"""Where Kueue keeps its webhook Secret (its ``namespace`` setting)."""
SERVICE: Final = "kueue-webhook-service"
"""Kueue's webhook Service name: it names the webhook configurations Kueue injects its CA into
(``kueue-{mutating,validating}-webhook-configuration``) and the DNS name of the certificate it
accepts. No Service exists; the name is only these two things here."""
SECRET: Final = "kueue-webhook-server-cert"
WEBHOOK_CONFIGS: Final = {
    "MutatingWebhookConfiguration": "kueue-mutating-webhook-configuration",
    "ValidatingWebhookConfiguration": "kueue-validating-webhook-configuration",
}
CONVERTED_CRDS: Final = (
    "localqueues",
    "clusterqueues",
    "cohorts",
    "workloads",
    "multikueueclusters",
)
"""The CRDs Kueue serves in two versions and converts (its kustomize ``webhook_in_*`` patches);
its certificate manager insists on injecting its CA into each one's conversion webhook."""
KUEUE_KINDS: Final = ("workloads", "localqueues", "clusterqueues", "resourceflavors")
"""Kueue's kinds a test creates, in the order they can be deleted (a flavor or queue in use
keeps its finalizer)."""


def kueue_build() -> tuple[Path, Path]:
    """The Kueue binary and its config folder (``crd/``, ``webhook.yaml``), built by
    ``tools/kueue/build.sh`` (instant once cached)."""
    result = subprocess.run(
        [str(KUEUE_BUILD)], capture_output=True, text=True, timeout=3600, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"tools/kueue/build.sh failed (exit {result.returncode}); it needs Go 1.26+ and "
            f"the Go module proxy once (run `make build`):\n{result.stderr[-4000:]}"
        )
    binary = Path(result.stdout.strip().splitlines()[-1])
    return binary, binary.parent / "config"


def _pem_cert(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: rsa.RSAPrivateKey) -> bytes:
    # PKCS#1 ("RSA PRIVATE KEY"): the form Kueue's certificate manager reads its CA key in.
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.TraditionalOpenSSL,
        serialization.NoEncryption(),
    )


_CA_USAGE: Final = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=True,
    data_encipherment=False,
    key_agreement=False,
    key_cert_sign=True,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


def serving_certs() -> dict[str, bytes]:
    """A CA and a serving certificate Kueue's certificate manager keeps as they are.

    It checks the CA against its own name (``kueue-ca``) and the serving certificate against
    ``<service>.<namespace>.svc`` with a 90-day look-ahead; the API server checks the serving
    certificate against ``127.0.0.1``. Both names are in it, and it is valid for a year.
    """
    now = datetime.datetime.now(datetime.UTC)
    begin, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=365)
    ca_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kueue-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(_CA_USAGE, critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("kueue-ca")]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SERVICE)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(begin)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName(f"{SERVICE}.{KUEUE_NAMESPACE}.svc"),
                    x509.IPAddress(ipaddress.IPv4Address("127.0.0.1")),
                ]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return {
        "ca.crt": _pem_cert(ca),
        "ca.key": _pem_key(ca_key),
        "tls.crt": _pem_cert(cert),
        "tls.key": _pem_key(key),
    }


def _selects(webhook: dict[str, Any], resource: str, group: str) -> bool:
    return any(
        resource in rule.get("resources", []) or group in rule.get("apiGroups", [])
        for rule in webhook.get("rules", [])
    )


def webhook_configurations(
    source: Path, *, port: int, ca: bytes, namespace: str
) -> list[dict[str, Any]]:
    """Kueue's webhook configurations, reached at ``127.0.0.1:port``: only the webhooks of
    Kueue's own kinds and of pods; the pod ones only in ``namespace``."""
    bundle = base64.b64encode(ca).decode()
    out = []
    for doc in yaml.safe_load_all(source.read_text()):
        if not doc:
            continue
        config = copy.deepcopy(doc)
        config["metadata"] = {"name": WEBHOOK_CONFIGS[config["kind"]]}
        hooks = []
        for hook in config["webhooks"]:
            pods = _selects(hook, "pods", "")
            if not (pods or _selects(hook, "", "kueue.x-k8s.io")):
                continue
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{port}{path}", "caBundle": bundle}
            if pods:
                hook["namespaceSelector"] = {
                    "matchLabels": {"kubernetes.io/metadata.name": namespace}
                }
            hooks.append(hook)
        config["webhooks"] = hooks
        out.append(config)
    return out


def crds(source: Path, *, port: int, ca: bytes) -> list[dict[str, Any]]:
    """Kueue's CRDs, with the conversion webhooks its kustomize patches add, at the URL."""
    bundle = base64.b64encode(ca).decode()
    out = []
    for path in sorted(source.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        if crd["spec"]["names"]["plural"] in CONVERTED_CRDS:
            crd["spec"]["conversion"] = {
                "strategy": "Webhook",
                "webhook": {
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{port}/convert",
                        "caBundle": bundle,
                    },
                    "conversionReviewVersions": ["v1"],
                },
            }
        out.append(crd)
    return out


def manager_config(*, namespace: str, webhook_port: int, health_port: int, cert_dir: Path) -> str:
    """Kueue's ``Configuration`` (config.kueue.x-k8s.io/v1beta2) for the local cluster."""
    only = {"matchLabels": {"kubernetes.io/metadata.name": namespace}}
    config = {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2",
        "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "manageJobsWithoutQueueName": False,
        "managedJobsNamespaceSelector": only,
        "leaderElection": {"leaderElect": False},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "webhook": {"host": "127.0.0.1", "port": webhook_port, "certDir": str(cert_dir)},
        "internalCertManagement": {
            "enable": True,
            "webhookServiceName": SERVICE,
            "webhookSecretName": SECRET,
        },
        "integrations": {"frameworks": ["pod"]},
        "featureGates": {"VisibilityOnDemand": False},
    }
    return yaml.safe_dump(config)


@dataclass
class Kueue:
    """A running Kueue manager: its log and the cluster it runs against."""

    cluster: LocalCluster
    namespace: str
    """The one namespace whose pods Kueue manages."""
    log: Path
    proc: subprocess.Popen[bytes]
    health_port: int

    def ready(self) -> bool:
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, lines: int = 80) -> str:
        """The end of Kueue's log (for failure messages)."""
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "(no Kueue log)"
        return "\n--- Kueue log ---\n" + "\n".join(text)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _apply(cluster: LocalCluster, objects: list[dict[str, Any]]) -> None:
    # Server-side: Kueue's Workload CRD is far over client-side apply's annotation limit.
    cluster.kubectl(
        "apply", "--server-side", "--force-conflicts", "--field-manager=baton-tests", "-f", "-",
        input=yaml.safe_dump_all(objects), timeout=120,
    )  # fmt: skip


def _wait_established(cluster: LocalCluster, names: list[str], timeout: float) -> None:
    """Wait until the CRDs are served. (Not `kubectl wait`: it fails at once on a CRD whose
    status has no conditions yet, as one read just after its creation can.)"""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        got = cluster.kubectl("get", "crd", *names, "-o", "json", check=False)
        if got.returncode == 0:
            waiting = [
                crd["metadata"]["name"]
                for crd in json.loads(got.stdout)["items"]
                if not any(
                    c["type"] == "Established" and c["status"] == "True"
                    for c in (crd.get("status") or {}).get("conditions") or []
                )
            ]
            if not waiting:
                return
            last = f"not Established: {waiting}"
        else:
            last = got.stderr.strip()
        time.sleep(0.5)
    raise AssertionError(f"Kueue's CRDs not Established within {timeout:.0f}s: {last}")


def _wait_ready(kueue: Kueue, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if kueue.proc.poll() is not None:
            raise AssertionError(f"Kueue exited ({kueue.proc.returncode}){kueue.tail()}")
        if kueue.ready():
            return
        time.sleep(0.5)
    raise AssertionError(f"Kueue not ready within {timeout:.0f}s{kueue.tail()}")


def _probe_pod(namespace: str) -> dict[str, Any]:
    """A pod Kueue's webhook must gate, for a server-side dry run (never created)."""
    from baton_testing.jobs import RESTRICTED_CONTAINER, RESTRICTED_POD

    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "kueue-webhook-probe",
            "namespace": namespace,
            "labels": {"kueue.x-k8s.io/queue-name": "probe"},
        },
        "spec": {
            "securityContext": dict(RESTRICTED_POD),
            "containers": [
                {
                    "name": "probe",
                    "image": "probe",
                    "command": ["true"],
                    "securityContext": dict(RESTRICTED_CONTAINER),
                }
            ],
        },
    }


def _wait_pod_webhook(kueue: Kueue, timeout: float) -> None:
    """Wait until a pod created in the namespace comes back gated by Kueue's webhook (the API
    server picks up new webhook configurations a moment after they are written)."""
    body = json.dumps(_probe_pod(kueue.namespace))
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        got = kueue.cluster.kubectl(
            "create", "--dry-run=server", "-o", "json", "-f", "-", input=body, check=False
        )
        if got.returncode == 0:
            gates = json.loads(got.stdout)["spec"].get("schedulingGates") or []
            if {"name": "kueue.x-k8s.io/admission"} in gates:
                return
            last = f"not gated: {gates}"
        else:
            last = got.stderr.strip()
        time.sleep(0.5)
    raise AssertionError(f"Kueue's pod webhook did not gate a pod within {timeout:.0f}s: {last}")


def _cleanup(cluster: LocalCluster, namespace: str, errors: list[str]) -> None:
    """While Kueue still runs (it removes its own finalizers): delete the test namespace's
    Kueue objects and the cluster-wide queues and flavors."""
    for kind in KUEUE_KINDS:
        scope = ["-A"] if kind in ("workloads", "localqueues") else []
        got = cluster.kubectl(
            "delete", kind, "--all", *scope, "--ignore-not-found", "--timeout=60s",
            check=False, timeout=90,
        )  # fmt: skip
        if got.returncode != 0:
            errors.append(f"delete {kind}: {got.stderr.strip()}")


def _release_pods(cluster: LocalCluster, namespace: str, errors: list[str]) -> None:
    """Kueue is gone: take its finalizer off any pod it left, or the pod would never go."""
    got = cluster.kubectl("get", "pods", "-n", namespace, "-o", "json", check=False)
    if got.returncode != 0:
        errors.append(f"list pods: {got.stderr.strip()}")
        return
    for pod in json.loads(got.stdout)["items"]:
        finalizers = pod["metadata"].get("finalizers") or []
        if "kueue.x-k8s.io/managed" not in finalizers:
            continue
        keep = [f for f in finalizers if f != "kueue.x-k8s.io/managed"]
        patch = json.dumps({"metadata": {"finalizers": keep or None}})
        done = cluster.kubectl(
            "patch", "pod", pod["metadata"]["name"], "-n", namespace, "--type", "merge",
            "-p", patch, check=False,
        )  # fmt: skip
        if done.returncode != 0 and "NotFound" not in done.stderr:
            errors.append(f"release pod {pod['metadata']['name']}: {done.stderr.strip()}")


@contextlib.contextmanager
def running_kueue(
    cluster: LocalCluster, namespace: str, workdir: Path, *, timeout: float = 180
) -> Iterator[Kueue]:
    """Kueue managing the pods of ``namespace`` (which must exist) until the block ends.

    On the way out: Kueue's objects are deleted while it runs, then it is stopped, its
    webhook configurations, CRDs and Secret removed; any step that fails is reported after
    all of them were tried (a leftover webhook would break later tests).
    """
    binary, config = kueue_build()
    workdir.mkdir(parents=True, exist_ok=True)
    cert_dir = workdir / "certs"
    cert_dir.mkdir(exist_ok=True)
    certs = serving_certs()
    for name in ("tls.crt", "tls.key"):
        (cert_dir / name).write_bytes(certs[name])
    webhook_port, health_port = free_port(), free_port()
    config_file = workdir / "kueue-config.yaml"
    config_file.write_text(
        manager_config(
            namespace=namespace, webhook_port=webhook_port, health_port=health_port,
            cert_dir=cert_dir,
        )
    )  # fmt: skip
    log = workdir / "kueue.log"
    k = cluster.kubectl
    kueue: Kueue | None = None
    try:
        k("create", "namespace", KUEUE_NAMESPACE, check=False)
        secret = {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": SECRET, "namespace": KUEUE_NAMESPACE},
            "type": "Opaque",
            "data": {name: base64.b64encode(value).decode() for name, value in certs.items()},
        }
        _apply(cluster, [secret])
        _apply(cluster, crds(config / "crd", port=webhook_port, ca=certs["ca.crt"]))
        _wait_established(cluster, [f"{p}.kueue.x-k8s.io" for p in KUEUE_KINDS], 120)
        hooks = webhook_configurations(
            config / "webhook.yaml", port=webhook_port, ca=certs["ca.crt"], namespace=namespace
        )
        _apply(cluster, hooks)
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        with log.open("ab") as out:
            proc = subprocess.Popen(
                # Verbosity 2: its scheduler's decisions (admitted, requeued) are in the log.
                [str(binary), f"--config={config_file}", "--zap-log-level=2"],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip
        kueue = Kueue(
            cluster=cluster, namespace=namespace, log=log, proc=proc, health_port=health_port
        )
        _wait_ready(kueue, timeout)
        _wait_pod_webhook(kueue, 60)
        yield kueue
    finally:
        errors: list[str] = []
        if kueue is not None and kueue.proc.poll() is None:
            _cleanup(cluster, namespace, errors)
        if kueue is not None:
            kueue.stop()
        for kind, name in WEBHOOK_CONFIGS.items():
            got = k("delete", kind.lower(), name, "--ignore-not-found", check=False)
            if got.returncode != 0:
                errors.append(f"delete {kind} {name}: {got.stderr.strip()}")
        _release_pods(cluster, namespace, errors)
        # The CRDs go without waiting: an object Kueue left a finalizer on would hold one
        # in Terminating, harmless, since nothing else in the session uses Kueue's kinds.
        crd_names = [
            f"crd/{p.stem.split('_', 1)[1]}.kueue.x-k8s.io" for p in (config / "crd").glob("*.yaml")
        ]
        got = k("delete", "--ignore-not-found", "--wait=false", *crd_names, check=False)
        if got.returncode != 0:
            errors.append(f"delete CRDs: {got.stderr.strip()}")
        k("delete", "namespace", KUEUE_NAMESPACE, "--ignore-not-found", "--wait=false", check=False)
        if errors:
            raise AssertionError(
                "Kueue's teardown failed: " + "; ".join(errors) + (kueue.tail() if kueue else "")
            )
