"""The Kubernetes manifests in deploy/kubernetes validate offline against the Kubernetes schemas, strictly (no
unknown field), and say what docs/platforms.md says they do."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
K8S = "1.31"  # the oldest release that all the fields used here are stable in (podFailurePolicy: 1.31)


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for f in sorted(DEPLOY.glob("*.yaml")):
        out += [(f"{f.name}:{d['kind']}", d) for d in yaml.safe_load_all(f.read_text()) if d]
    return out


@pytest.mark.parametrize(("name", "doc"), documents(), ids=[n for n, _ in documents()])
def test_every_manifest_validates_strictly(name: str, doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def test_the_validation_can_fail() -> None:
    job = copy.deepcopy(dict(documents())["training-job.yaml:Job"])
    job["spec"]["template"]["spec"]["containers"][0]["gracePeriod"] = 60  # no such field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, K8S, strict=True)


def test_the_training_job_resumes_after_a_suspension() -> None:
    job = dict(documents())["training-job.yaml:Job"]
    pod = job["spec"]["template"]["spec"]
    cmd = pod["containers"][0]["command"]
    grace = float(cmd[cmd.index("--grace") + 1].rstrip("s"))
    assert grace + 5 <= pod["terminationGracePeriodSeconds"]  # the agent records the outcome before SIGKILL
    rules = job["spec"]["podFailurePolicy"]["rules"]
    assert any(r["action"] == "Ignore" and r.get("onExitCodes", {}).get("values") == [75] for r in rules)
    assert "--fresh" not in cmd and "--store" in cmd  # the replacement pod resumes from the store
