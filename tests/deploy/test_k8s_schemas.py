"""Every manifest `pdserve render k8s` writes for configs/ is a valid Kubernetes
object, checked offline against the API schemas that kubernetes-validate ships."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from tests.deploy.manifests import CONFIGS, container, render

# the oldest release still common in managed clusters, and the newest the package ships
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.stem for c in CONFIGS])
def test_every_rendered_object_validates_strictly_against_the_api_schemas(config, tmp_path):
    m = render(config, tmp_path)
    kinds = sorted(o["kind"] for o in m.objects)
    roles = [r for r in ("prefill", "decode", "colocated") if m.pod_config().model_dump()[r]]
    instances = len(m.pod_config().instances())
    assert kinds == sorted(
        ["ConfigMap", "Deployment", "Service"]
        + ["Service"] * len(roles)
        + ["StatefulSet"] * instances
        + ["PodDisruptionBudget", "NetworkPolicy"] * (len(roles) + 1)
    )
    for obj in m.objects:
        for version in VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)  # raises on any error


def test_the_schema_check_rejects_a_misspelt_field_and_a_wrong_type(tmp_path):
    """Guards the test above: the validation is not vacuous."""
    m = render(CONFIGS[0], tmp_path)
    sts = m.of_kind("StatefulSet")[0]
    typo = copy.deepcopy(sts)
    container(typo)["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(typo, VERSIONS[0], strict=True)
    wrong = copy.deepcopy(sts)
    wrong["spec"]["replicas"] = "one"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, VERSIONS[0], strict=True)
