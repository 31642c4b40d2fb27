"""The chart's switches for the two TLS meshes it does not make by default: the placement
advisor's mutual TLS (placementAdvisor.tls, certificates the chart issues) and plaintext IMEX
meshes (imexMesh.tls=false, the controller's --imex-mesh-tls). That the rendered flags, mounts and
certificates really start the advisor with mutual TLS is tests/k8s/test_helm_services.py's."""

from __future__ import annotations

import base64
import posixpath
from pathlib import Path
from typing import Any

import pytest
import yaml
from cryptography import x509

from tests.manifests.helm import render
from tests.manifests.objects import NAMESPACE, Obj, container, find, flags, mounts, of_kind, pod_spec

ADVISOR_SECRETS = ("cd-placement-advisor-ca", "cd-placement-advisor-tls", "cd-scheduler-advisor-client-tls")
SCHEDULER_NAME = "computedomain-scheduler"


@pytest.fixture(scope="module")
def secured(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    values = {"placementAdvisor": {"tls": {"enabled": True}}, "schedulerPlugin": {"enabled": True}}
    return render(helm, NAMESPACE, values, tmp_path_factory.mktemp("advisor-tls"))


def secret_file(objects: list[Obj], workload: Obj, c: dict[str, Any], path: str) -> bytes:
    """The bytes a container reads at `path` when it lies in a mounted Secret."""
    for mount_path, (_, volume) in mounts(workload, c).items():
        if path.startswith(mount_path.rstrip("/") + "/") and "secret" in volume:
            secret = find(objects, "Secret", volume["secret"]["secretName"])
            return base64.b64decode(secret["data"][posixpath.relpath(path, mount_path)])
    raise AssertionError(f"{path} is in no Secret mounted in {workload['metadata']['name']}")


def certificate(data: bytes) -> x509.Certificate:
    return x509.load_pem_x509_certificate(data)


def common_name(cert: x509.Certificate) -> str:
    [cn] = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    return str(cn.value)


def test_by_default_the_advisor_serves_plaintext_and_domains_get_tls_meshes(helm: Path) -> None:
    objects = render(helm, NAMESPACE)
    advisor = container(find(objects, "Deployment", "cd-placement-advisor"))
    assert not {"--tls-cert-file", "--tls-key-file", "--tls-client-ca-file"} & set(flags(advisor))
    assert not [s for s in of_kind(objects, "Secret") if s["metadata"]["name"] in ADVISOR_SECRETS]
    # The controller's own default (true) decides: the chart gives no flag.
    assert "--imex-mesh-tls" not in flags(container(find(objects, "Deployment", "cd-controller")))


def test_plaintext_imex_meshes_are_the_controllers_flag(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, NAMESPACE, {"imexMesh": {"tls": False}}, tmp_path)
    assert flags(container(find(objects, "Deployment", "cd-controller")))["--imex-mesh-tls"] == "false"
    for kind in ("Deployment", "DaemonSet"):
        for workload in of_kind(objects, kind):
            if workload["metadata"]["name"] != "cd-controller":
                assert "--imex-mesh-tls" not in flags(container(workload)), workload["metadata"]["name"]


def test_the_advisor_requires_client_certificates_of_the_charts_ca(secured: list[Obj]) -> None:
    workload = find(secured, "Deployment", "cd-placement-advisor")
    c = container(workload)
    f = flags(c)
    ca = certificate(base64.b64decode(find(secured, "Secret", "cd-placement-advisor-ca")["data"]["ca.crt"]))
    server = certificate(secret_file(secured, workload, c, f["--tls-cert-file"]))
    server.verify_directly_issued_by(ca)
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"cd-placement-advisor.{NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName)
    assert certificate(secret_file(secured, workload, c, f["--tls-client-ca-file"])) == ca
    assert secret_file(secured, workload, c, f["--tls-key-file"]).startswith(b"-----BEGIN")
    # Renewed certificates roll the advisor.
    annotations = workload["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["computedomains.nvidia.com/advisor-certs-expiry-day"]) > 0


def test_cd_scheduler_presents_a_client_certificate_named_for_its_holder(secured: list[Obj]) -> None:
    workload = find(secured, "Deployment", "cd-scheduler")
    c = container(workload)
    config = yaml.safe_load(find(secured, "ConfigMap", "cd-scheduler-config")["data"]["config.yaml"])
    [args] = [
        p["args"] for p in config["profiles"][0]["pluginConfig"] if p["name"] == "ComputeDomainPlacement"
    ]
    ca = certificate(base64.b64decode(find(secured, "Secret", "cd-placement-advisor-ca")["data"]["ca.crt"]))
    client = certificate(secret_file(secured, workload, c, args["certFile"]))
    client.verify_directly_issued_by(ca)
    # The advisor charges reservations to the certificate's name, and only their holder may
    # release them: the name must be the holder the plugin declares.
    assert common_name(client) == args["holder"] == SCHEDULER_NAME
    assert certificate(secret_file(secured, workload, c, args["caFile"])) == ca
    assert args["serverName"] == f"cd-placement-advisor.{NAMESPACE}.svc"
    assert args["advisorAddress"].startswith(args["serverName"] + ":")
    # The Secret's files are 0440 and the scheduler runs as 65532: its group must be able to read.
    [volume] = [v for v in pod_spec(workload)["volumes"] if v["name"] == "advisor-tls"]
    assert volume["secret"]["defaultMode"] & 0o040
    assert (
        pod_spec(workload)["securityContext"]["fsGroup"]
        == pod_spec(workload)["securityContext"]["runAsGroup"]
    )


def test_without_cd_scheduler_no_client_certificate_is_issued(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, NAMESPACE, {"placementAdvisor": {"tls": {"enabled": True}}}, tmp_path)
    names = {s["metadata"]["name"] for s in of_kind(objects, "Secret")}
    assert {"cd-placement-advisor-ca", "cd-placement-advisor-tls"} <= names
    assert "cd-scheduler-advisor-client-tls" not in names
