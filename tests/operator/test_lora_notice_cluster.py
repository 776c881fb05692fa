"""A LoRA job on spot nodes: its notice save writes only what changed and commits inside a GKE
notice (issue 27, "Notice saves fit").

A 3-replica TrainingJob of the deterministic trainer in its LoRA shape (``--lora-rank``,
``--frozen-base-mib``: a frozen base of :data:`BASE_MIB` MiB, ``requires_grad=False``, and a
rank-4 adapter with the head trained) saves every :data:`EVERY` steps. Its first durable save
writes the base once (about :data:`BASE_MIB` MiB over the 3 ranks; on this machine's disk a
sizable share of the notice window by itself); every later save references it.

After a later, incremental periodic save the ranks hold (``--hold-at``) and rank 1's node gets
a GKE spot notice (the machine goes 30 s later; the operator gives non-system pods the 15 s GKE
leaves them, and the node's graceful shutdown SIGTERMs its pod at once). The ranks go on once
the operator's checkpoint requests, which carry that deadline, have reached the sidecars, so
that the save is judged by the deadline logic (a SIGTERM alone carries no deadline, and would
be saved unjudged), as a notice during a step is. The test checks, from the job's
``status.interruptions`` record, that the notice save committed the step the next attempt
resumes from, with ``noticeToDurableSeconds`` inside the window and no fallback; from the
step's manifest in the checkpoint storage, that the save was the notice's, wrote the adapter,
its optimizer state and the small state only (under 1 % of the base's bytes) and references
the base where the first save wrote it; and that the job then ran on other nodes and
Succeeded, every rank of the last attempt exiting 0, with losses and final state bitwise equal
to an uninterrupted run of the same trainer.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest
from baton_testing import trainer
from baton_testing.operator_harness import Baton, PodWatcher, unique

from trainer_sdk.api import read_manifest
from trainer_sdk.wire import Trigger

pytestmark = pytest.mark.cluster

SHARED_OPERATOR = True

STEPS = 30
REPLICAS = 3
EVERY = 5
"""Periodic durable saves: the first (step 5) writes the base, the later ones reference it."""
BASE_MIB = 256
"""The frozen base (an embedding table, float32): 268 MB, written once."""
LORA = ["--lora-rank", "4", "--frozen-base-mib", str(BASE_MIB)]
TABLE_BYTES = BASE_MIB << 20
HOLD_AT = 12
"""The ranks hold after this step, past the second (incremental) periodic save, until the
notice's requests have reached them; the notice save is of this step or the next."""


def _time(value: str) -> datetime:
    return datetime.fromisoformat(value.replace("Z", "+00:00"))


def _trainer_exit_codes(baton: Baton, job: str, attempt: int) -> dict[int, int | None]:
    """Rank -> the trainer container's exit code in ``attempt``'s pods (None: not ended)."""
    codes: dict[int, int | None] = {}
    for pod in baton.pods(job):
        labels = pod["metadata"]["labels"]
        if labels["baton.dev/attempt"] != str(attempt):
            continue
        code = None
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs["name"] == "trainer":
                code = ((cs.get("state") or {}).get("terminated") or {}).get("exitCode")
        codes[int(labels["baton.dev/rank"])] = code
    return codes


def test_a_lora_job_commits_its_notice_save_inside_a_gke_notice(
    baton: Baton, tmp_path: Path
) -> None:
    train = ["--steps", str(STEPS), "--every-steps", str(EVERY), *LORA]
    ref = trainer.reference(tmp_path / "reference", REPLICAS, train)
    baton.cluster.add_node()  # replaces the node this test takes away
    job = unique("tj-lora")
    out = baton.workdir / job
    manifest = baton.job_manifest(
        job, steps=STEPS, every_steps=EVERY, sleep=0.3, replicas=REPLICAS
    )  # fmt: skip
    hold = ["--hold-at", str(HOLD_AT), "--hold-dir", str(out)]
    manifest["spec"]["template"]["spec"]["containers"][0]["command"] += [*LORA, *hold]
    applied = baton.apply(manifest)
    assert applied.returncode == 0, applied.stderr
    watcher = PodWatcher(baton, job)
    baton.wait_phase(job, "Running", timeout=180)
    before = datetime.now(tz=UTC)
    node, at_restart = baton.notice_while_held(
        job, out, hold_at=HOLD_AT, replicas=REPLICAS, provider="gke", grace_s=30
    )
    diag = baton.diagnostics(job)
    last = at_restart.get("lastCheckpoint") or {}
    step = int(last.get("step", 0))
    assert last.get("trigger") == "notice", f"the restart did not follow a notice save{diag}"
    # Served at the boundary where the ranks heard it, or at the next: the trainer's steps are
    # shorter than notice_overlap_below (1 s), so its notice agreement overlaps a step.
    assert step in (HOLD_AT, HOLD_AT + 1), diag
    assert at_restart.get("resumedFromStep") == step, diag
    (entry,) = at_restart["interruptions"]
    assert (entry["attempt"], entry["source"]) == (0, "gke"), entry
    assert node in entry["nodes"], entry
    assert before.replace(microsecond=0) <= _time(entry["noticeAt"]), entry
    # The window: from the notice to the deadline the operator set (GKE's 15 s for pods).
    window = entry["leadSeconds"]
    assert window == (_time(entry["deadline"]) - _time(entry["noticeAt"])).total_seconds()
    assert 0 <= entry["noticeToDurableSeconds"] < window, entry
    assert (entry["resumeStep"], entry["stepsLost"]) == (step, 0), entry
    events = baton.events(job)
    assert not [e for e in events if e.startswith("CheckpointFallback")], diag
    assert any(e.startswith("CheckpointCommitted") and f"step {step}" in e for e in events), diag
    assert baton.resume_env(job, 1) <= {str(step)}, diag

    # What the notice save wrote: the adapter, its optimizer state and the small state; the
    # base is referenced where the first save wrote it.
    uri = str(out / "ckpt")
    first, notice = read_manifest(uri, EVERY), read_manifest(uri, step)
    print(
        f"\nfirst save (step {EVERY}): wrote {first.total_bytes} B; notice save (step {step}): "
        f"wrote {notice.total_bytes} B, references {notice.referenced_bytes} B; notice to "
        f"durable {entry['noticeToDurableSeconds']} s of a {window} s window"
    )
    assert first.total_bytes >= TABLE_BYTES, first.total_bytes
    # The ranks agreed on the requests (and their deadline), not on the SIGTERM alone: the
    # deadline logic judged this save, and it fit.
    assert notice.trigger == Trigger.NOTICE, notice.trigger
    assert notice.total_bytes < TABLE_BYTES / 100, notice.total_bytes
    assert notice.referenced_bytes >= TABLE_BYTES, notice.referenced_bytes
    (table,) = [k for k in notice.tensors if k.endswith("table")]
    pieces = notice.tensors[table].pieces
    assert pieces, notice.tensors[table]
    assert all(notice.files[p.file].step == EVERY for p in pieces), pieces
    trained = [k for k in notice.tensors if "lora_" in k or "head" in k]
    assert trained, sorted(notice.tensors)
    for key in trained:
        assert all(notice.files[p.file].step is None for p in notice.tensors[key].pieces), key

    final = baton.wait_moved_once(job, node, watcher, replicas=REPLICAS)
    diag = baton.diagnostics(job)
    assert (final["attempt"], final["stepsLost"]) == (1, 0), diag
    codes = _trainer_exit_codes(baton, job, 1)
    assert codes == dict.fromkeys(range(REPLICAS), 0), f"exit codes {codes}{diag}"
    trainer.assert_equal_to_reference(out, REPLICAS, STEPS, ref, diag)
    baton.delete(job)
