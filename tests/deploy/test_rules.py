"""The alert rules load in promtool and fire (and stay quiet) when they should.

`promtool test rules` evaluates the real rules file over synthetic series, so each alert's
threshold and `for` are checked as Prometheus itself would evaluate them.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import yaml
from baton_testing.prometheus import promtool_binary

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "baton-rules.yaml"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool_binary(), *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_rules_file_passes_promtool_check() -> None:
    result = _promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 5 rules found" in result.stdout + result.stderr


def test_promtool_check_rejects_a_broken_rule(tmp_path: Path) -> None:
    # The check above means something only if promtool really parses the PromQL.
    rules = yaml.safe_load(RULES.read_text())
    rules["groups"][0]["rules"][0]["expr"] = "histogram_quantile(0.05, sum by (le) (rate(x[5m]))"
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(rules))
    result = _promtool("check", "rules", str(broken))
    assert result.returncode != 0
    assert "parse error" in (result.stdout + result.stderr).lower()


def _alert(name: str, at: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """Expect alert ``name`` at ``at`` with ``labels`` (plus its rule's own), or none at all."""
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    own = next(r.get("labels", {}) for r in rules if r["alert"] == name)
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [{"exp_labels": {**labels, **own}}] if labels is not None else [],
    }


def _run_unit_tests(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    # promtool compares annotations too, and ours quote $value in prose; the firing logic
    # (expr, for, labels) is what this test is about, so it runs on a copy without them.
    # `promtool check rules` above validates the annotation templates of the real file.
    rules = yaml.safe_load(RULES.read_text())
    for rule in rules["groups"][0]["rules"]:
        rule.pop("annotations", None)
    rules_copy = tmp_path / "rules.yaml"
    rules_copy.write_text(yaml.safe_dump(rules))
    spec = tmp_path / "rules_test.yaml"
    spec.write_text(
        yaml.safe_dump(
            {"rule_files": [str(rules_copy)], "evaluation_interval": "1m", "tests": tests}
        )
    )
    result = _promtool("test", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


def _matches(alert: dict[str, Any]) -> bool:
    return bool(alert["exp_alerts"])


def test_alerts_fire_on_their_conditions_and_not_before(tmp_path: Path) -> None:
    job = {"namespace": "ml", "job": "pretrain"}
    sel = 'namespace="ml", job="pretrain"'

    # Deadline margin histogram with buckets like the sidecar's: notice saves every 5 min.
    # "slim": every save commits 2-5 s before its deadline; "roomy": 30-60 s before.
    def margin(le: str, per_save: int, instance: str = "operator:8080") -> dict[str, str]:
        labels = f'{sel}, le="{le}", instance="{instance}"'
        return {
            "series": f"baton_checkpoint_deadline_margin_seconds_bucket{{{labels}}}",
            "values": f"0+{per_save}x60",
        }

    # A sidecar exports its own per-pod margin histogram (other buckets) under the same name;
    # the alert must judge the operator's alone.
    pod = "10.0.0.7:9440"
    sidecar_slim = [
        margin("-1", 0, pod),
        margin("1", 1, pod),
        margin("5", 1, pod),
        margin("+Inf", 1, pod),
        {
            "series": f'baton_checkpoint_phase_seconds_count{{{sel}, phase="write", '
            f'instance="{pod}"}}',
            "values": "0+1x60",
        },
    ]

    slim = [margin("1", 0), margin("5", 1), margin("10", 1), margin("60", 1), margin("+Inf", 1)]
    roomy = [margin("1", 0), margin("5", 0), margin("10", 0), margin("60", 1), margin("+Inf", 1)]
    restarts = {"series": f'baton_restarts_total{{{sel}, reason="failure"}}'}
    tests: list[dict[str, Any]] = [
        {
            "interval": "1m",
            "input_series": slim,
            "alert_rule_test": [_alert("BatonCheckpointNearDeadline", "40m", job)],
        },
        {
            "interval": "1m",
            "input_series": roomy + sidecar_slim,
            "alert_rule_test": [_alert("BatonCheckpointNearDeadline", "40m")],
        },
        {
            # The last checkpoint was at t=0 and never again: silent for an hour, then `for: 10m`.
            "interval": "1m",
            "input_series": [
                {
                    "series": f"baton_last_checkpoint_timestamp_seconds{{{sel}}}",
                    "values": "0x120",
                }
            ],
            "alert_rule_test": [
                _alert("BatonNoRecentCheckpoint", "65m"),
                _alert("BatonNoRecentCheckpoint", "75m", job),
            ],
        },
        {
            # One restart every 15 minutes is not a loop; one every 5 minutes is.
            "interval": "1m",
            "input_series": [{**restarts, "values": "0 0 0 0 0 1 1 1 1 1 2 2 2 2 2 3 3 3 3 3 4"}],
            "alert_rule_test": [_alert("BatonRestartLoop", "20m", job)],
        },
        {
            "interval": "1m",
            "input_series": [{**restarts, "values": "0+0x14 1+0x14 2+0x14 3+0x14"}],
            "alert_rule_test": [_alert("BatonRestartLoop", "59m")],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": f"baton_failure_budget_remaining{{{sel}}}", "values": "3 3 2 2 1 1 0"}
            ],
            "alert_rule_test": [
                _alert("BatonFailureBudgetNearlySpent", "3m"),
                _alert("BatonFailureBudgetNearlySpent", "4m", job),
                _alert("BatonFailureBudgetNearlySpent", "6m", job),
            ],
        },
        {
            # Goodput 0.7 from t=0: pending for 30 minutes, then firing; 0.85 never fires, and a
            # dip below 0.8 that recovers within 30 minutes does not either.
            "interval": "1m",
            "input_series": [{"series": f"baton_goodput_ratio{{{sel}}}", "values": "0.7x60"}],
            "alert_rule_test": [
                _alert("BatonLowGoodput", "25m"),
                _alert("BatonLowGoodput", "35m", job),
            ],
        },
        {
            "interval": "1m",
            "input_series": [
                {"series": f"baton_goodput_ratio{{{sel}}}", "values": "0.7x20 0.85x40"},
            ],
            "alert_rule_test": [_alert("BatonLowGoodput", "45m")],
        },
    ]
    # Both outcomes are covered for every alert: it fires, and it stays quiet.
    names = {a["alertname"] for t in tests for a in t["alert_rule_test"]}
    assert names == {r["alert"] for r in yaml.safe_load(RULES.read_text())["groups"][0]["rules"]}
    for name in names:
        outcomes = {
            _matches(a) for t in tests for a in t["alert_rule_test"] if a["alertname"] == name
        }
        assert outcomes == {True, False}, name
    _run_unit_tests(tmp_path, tests)
