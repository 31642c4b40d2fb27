"""The Helm chart (deployments/helm/compute-domains) renders what the kustomize base renders, and
each value does what docs/operations.md says. Rendered by the real helm (tools/helm/build.sh)."""

from __future__ import annotations

import base64
import copy
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from libs.state import roles
from tests.manifests.helm import CHART, HelmError, render
from tests.manifests.kustomize import object_id
from tests.manifests.objects import (
    IMAGE,
    NAMESPACE,
    PRIORITY_CLASSES,
    Obj,
    container,
    find,
    flags,
    of_kind,
    pod_spec,
)
from tests.manifests.test_workloads import HA_ETCD_MEMBERS, WORKLOADS

NODE_DAEMONSETS = ("cd-node-agent", "cd-imex-agent")


@pytest.fixture(scope="module")
def chart(helm: Path) -> list[Obj]:
    """The chart with its default values, into the base's namespace."""
    return render(helm, NAMESPACE)


def chart_with(helm: Path, tmp_path: Path, values: dict[str, Any], namespace: str = NAMESPACE) -> list[Obj]:
    return render(helm, namespace, values, tmp_path)


def without_pull_policy(spec: dict[str, Any]) -> dict[str, Any]:
    # The chart sets image.pullPolicy explicitly; the base leaves it to the API server's default.
    spec = copy.deepcopy(spec)
    for c in spec["template"]["spec"]["containers"]:
        c.pop("imagePullPolicy", None)
    return spec


# --- the default render is the production overlay, with its etcd ---------------------------

# What the chart adds to the production overlay: the etcd certificates it makes (the overlay
# expects them made by hand) and the Job that gives etcd its users and roles.
CHART_ETCD_OBJECTS = {
    ("", "Secret", NAMESPACE, name)
    for name in (
        "cd-etcd-ca",
        "cd-etcd-server-tls",
        "cd-etcd-peer-tls",
        "cd-etcd-client-root",
        "cd-etcd-client-controller",
        "cd-etcd-client-node-agent",
        "cd-etcd-client-imex-agent",
        "cd-etcd-client-placement-advisor",
    )
} | {("batch", "Job", NAMESPACE, "cd-etcd-roles")}
# Flags the chart gives that the overlay leaves at the services' defaults, and the advisor's mutual
# TLS, which the overlay adds and the chart does not (the extender's client certificate is the
# scheduler's configuration).
CHART_ONLY_FLAGS = ("--log-level", "--etcd-prefix")
ADVISOR_TLS_FLAGS = ("--tls-cert-file", "--tls-key-file", "--tls-client-ca-file")
CERTS_ANNOTATION = "computedomains.nvidia.com/etcd-certs-expiry-day"


@pytest.fixture(scope="module")
def like_production(helm: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Obj]:
    """The chart with the overlay's driver root (the GPU operator's)."""
    return render(helm, NAMESPACE, {"nvidiaDriverRoot": "/run/nvidia/driver"}, tmp_path_factory.mktemp("v"))


def test_same_objects_as_production_plus_its_certificates_and_roles(
    production: list[Obj], chart: list[Obj]
) -> None:
    # The Namespace: `helm install` keeps its release in the namespace, so it must exist before
    # the chart's objects (createNamespace renders it, tested below).
    production_ids = {object_id(o) for o in production if o["kind"] != "Namespace"}
    assert {object_id(o) for o in chart} == production_ids | CHART_ETCD_OBJECTS


def test_create_namespace_renders_the_base_namespace(base: list[Obj], helm: Path, tmp_path: Path) -> None:
    objects = chart_with(helm, tmp_path, {"createNamespace": True})
    [ours], [theirs] = of_kind(objects, "Namespace"), of_kind(base, "Namespace")
    assert ours["metadata"]["name"] == theirs["metadata"]["name"]
    assert theirs["metadata"]["labels"].items() <= ours["metadata"]["labels"].items()


def test_static_objects_are_the_base_objects(base: list[Obj], chart: list[Obj]) -> None:
    for kind in ("CustomResourceDefinition", "DeviceClass", "ValidatingAdmissionPolicy", "ServiceAccount"):
        for theirs in of_kind(base, kind):
            ours = find(chart, kind, theirs["metadata"]["name"])
            assert {k: v for k, v in ours.items() if k != "metadata"} == {
                k: v for k, v in theirs.items() if k != "metadata"
            }, f"{kind} {theirs['metadata']['name']}"


def test_the_crd_is_a_template_kept_on_uninstall(chart: list[Obj]) -> None:
    # A template, so `helm upgrade` upgrades it (crds/ is installed once, never upgraded); kept,
    # because deleting it would delete every ComputeDomain.
    [crd] = of_kind(chart, "CustomResourceDefinition")
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert not (CHART / "crds").exists()


def test_rbac_rules_and_subjects_are_the_bases(base: list[Obj], chart: list[Obj]) -> None:
    for theirs in of_kind(base, "ClusterRole"):
        assert find(chart, "ClusterRole", theirs["metadata"]["name"])["rules"] == theirs["rules"]
    for theirs in of_kind(base, "ClusterRoleBinding"):
        ours = find(chart, "ClusterRoleBinding", theirs["metadata"]["name"])
        assert (ours["roleRef"], ours["subjects"]) == (theirs["roleRef"], theirs["subjects"])


def _by_name(items: list[dict[str, Any]], leave_out: tuple[str, ...] = ()) -> dict[str, Any]:
    # kustomize's patches put their entries first; the order means nothing.
    return {i["name"]: i for i in items if i["name"] not in leave_out}


@pytest.mark.parametrize(("kind", "name"), WORKLOADS)
def test_workloads_are_productions(
    production: list[Obj], like_production: list[Obj], kind: str, name: str
) -> None:
    theirs, ours = find(production, kind, name), find(like_production, kind, name)
    ours_flags, theirs_flags = flags(container(ours)), flags(container(theirs))
    assert ours_flags["--log-level"] == "info"  # NVIDIA's default logVerbosity, 4
    assert ours_flags["--etcd-prefix"] == "/cd/v1/"
    assert {k: v for k, v in ours_flags.items() if k not in CHART_ONLY_FLAGS} == {
        k: v for k, v in theirs_flags.items() if k not in ADVISOR_TLS_FLAGS
    }
    assert _by_name(container(ours)["env"]) == _by_name(container(theirs)["env"])
    assert _by_name(container(ours)["volumeMounts"]) == _by_name(
        container(theirs)["volumeMounts"], ("advisor-tls",)
    )
    assert _by_name(pod_spec(ours)["volumes"]) == _by_name(pod_spec(theirs)["volumes"], ("advisor-tls",))
    assert container(ours)["image"] == IMAGE
    annotations = dict(ours["spec"]["template"]["metadata"]["annotations"])
    # Renewed certificates roll the pods that mount them.
    assert int(annotations.pop(CERTS_ANNOTATION)) > 0
    assert annotations == theirs["spec"]["template"]["metadata"]["annotations"]
    # Both node DaemonSets: GPU nodes by NVIDIA's affinity instead of the overlay's nodeSelector.
    scheduling = ("nodeSelector", "affinity")
    assert {k: v for k, v in pod_spec(ours).items() if k not in ("containers", "volumes", *scheduling)} == {
        k: v for k, v in pod_spec(theirs).items() if k not in ("containers", "volumes", *scheduling)
    }


def test_etcd_is_the_production_overlays(production: list[Obj], chart: list[Obj]) -> None:
    ours, theirs = find(chart, "StatefulSet", "cd-etcd"), find(production, "StatefulSet", "cd-etcd")
    ours_spec = copy.deepcopy(ours["spec"])
    assert int(ours_spec["template"]["metadata"]["annotations"].pop(CERTS_ANNOTATION)) > 0
    assert ours_spec == theirs["spec"]
    for kind in ("Service", "PodDisruptionBudget"):
        assert find(chart, kind, "cd-etcd")["spec"] == find(production, kind, "cd-etcd")["spec"]


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("Service", "cd-placement-advisor"),
        ("PodDisruptionBudget", "cd-controller"),
        ("NetworkPolicy", "cd-placement-advisor"),
    ],
)
def test_services_and_policies_are_the_bases(base: list[Obj], chart: list[Obj], kind: str, name: str) -> None:
    assert find(chart, kind, name)["spec"] == find(base, kind, name)["spec"]


def test_admission_bindings_name_the_namespace_as_their_parameter(chart: list[Obj]) -> None:
    # A namespace made by `helm install --create-namespace` lacks the label the base's bindings
    # select by; the chart names it instead.
    for binding in of_kind(chart, "ValidatingAdmissionPolicyBinding"):
        assert binding["spec"]["paramRef"] == {"name": NAMESPACE, "parameterNotFoundAction": "Allow"}
        assert binding["spec"]["validationActions"] == ["Deny"]


# --- values ----------------------------------------------------------------------------------


def test_namespace_override_moves_every_namespaced_object(helm: Path, tmp_path: Path) -> None:
    objects = chart_with(helm, tmp_path, {"namespaceOverride": "gpu-system"}, namespace="default")
    for obj in objects:
        namespace = obj["metadata"].get("namespace")
        assert namespace in (None, "gpu-system"), object_id(obj)
        for subject in obj.get("subjects") or []:
            assert subject["namespace"] == "gpu-system"
    for binding in of_kind(objects, "ValidatingAdmissionPolicyBinding"):
        assert binding["spec"]["paramRef"]["name"] == "gpu-system"
    endpoint = flags(container(find(objects, "Deployment", "cd-controller")))["--etcd-endpoint"]
    assert endpoint == ",".join(f"cd-etcd-{i}.cd-etcd.gpu-system.svc:2379" for i in range(3))
    etcd = container(find(objects, "StatefulSet", "cd-etcd"))
    assert "--initial-cluster-token=cd-etcd" in etcd["command"]
    assert not [arg for arg in etcd["command"] if NAMESPACE in arg]


def test_priority_classes_default_and_override(chart: list[Obj], helm: Path, tmp_path: Path) -> None:
    assert {
        name: pod_spec(find(chart, kind, name))["priorityClassName"] for kind, name in WORKLOADS
    } == PRIORITY_CLASSES
    values = {
        component: {"priorityClassName": f"{component}-priority"}
        for component in ("controller", "placementAdvisor", "kubeletPlugin", "imexAgent")
    }
    objects = chart_with(helm, tmp_path, values)
    assert [pod_spec(find(objects, kind, name))["priorityClassName"] for kind, name in WORKLOADS] == [
        "controller-priority",
        "placementAdvisor-priority",
        "kubeletPlugin-priority",
        "imexAgent-priority",
    ]


@pytest.mark.parametrize("root", [None, "/run/nvidia/driver"])
def test_nvidia_driver_root_is_the_driver_root_volume(helm: Path, tmp_path: Path, root: str | None) -> None:
    # NVIDIA's default: / (a driver installed on the host).
    objects = chart_with(helm, tmp_path, {"nvidiaDriverRoot": root} if root else {})
    for name in NODE_DAEMONSETS:
        volumes = {v["name"]: v for v in pod_spec(find(objects, "DaemonSet", name))["volumes"]}
        assert volumes["driver-root"]["hostPath"]["path"] == (root or "/")


def test_kubelet_directories_move_the_flag_mounts_and_volumes(helm: Path, tmp_path: Path) -> None:
    kubelet = "/var/lib/k0s/kubelet"
    values = {
        "kubeletPlugin": {
            "kubeletRegistrarDirectoryPath": f"{kubelet}/plugins_registry",
            "kubeletPluginsDirectoryPath": f"{kubelet}/plugins",
        }
    }
    agent = find(chart_with(helm, tmp_path, values), "DaemonSet", "cd-node-agent")
    assert flags(container(agent))["--kubelet-dir"] == kubelet
    mounts = {m["name"]: m["mountPath"] for m in container(agent)["volumeMounts"]}
    paths = {v["name"]: v["hostPath"]["path"] for v in pod_spec(agent)["volumes"] if "hostPath" in v}
    for name, path in (
        ("plugins-registry", f"{kubelet}/plugins_registry"),
        ("plugins", f"{kubelet}/plugins"),
    ):
        # Same path inside as on the host: kubelet dials the socket path the plugin registers.
        assert mounts[name] == paths[name] == path


def test_kubelet_directories_of_two_kubelet_dirs_are_refused(helm: Path, tmp_path: Path) -> None:
    values = {"kubeletPlugin": {"kubeletRegistrarDirectoryPath": "/a/plugins_registry"}}
    with pytest.raises(HelmError, match="must be <dir>/plugins_registry and <dir>/plugins"):
        chart_with(helm, tmp_path, values)


@pytest.mark.parametrize(
    ("verbosity", "level"),
    [("debug", "debug"), ("warning", "warning"), ("4", "info"), ("6", "debug"), (0, "info"), (7, "debug")],
)
def test_log_verbosity_sets_every_services_log_level(
    helm: Path, tmp_path: Path, verbosity: str | int, level: str
) -> None:
    objects = chart_with(helm, tmp_path, {"logVerbosity": verbosity})
    for kind, name in WORKLOADS:
        assert flags(container(find(objects, kind, name)))["--log-level"] == level


def test_a_log_verbosity_no_service_knows_is_refused(helm: Path, tmp_path: Path) -> None:
    with pytest.raises(HelmError, match="logVerbosity"):
        chart_with(helm, tmp_path, {"logVerbosity": "verbose"})


def test_image_pull_secrets_and_scheduling_values(helm: Path, tmp_path: Path) -> None:
    toleration = {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["yes"]}]}
                ]
            }
        }
    }
    values: dict[str, Any] = {
        "image": {"repository": "registry.example/cd", "tag": "1.2.3", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "pull"}],
        "controller": {
            "replicas": 3,
            "nodeSelector": {"role": "infra"},
            "tolerations": [toleration],
            "affinity": affinity,
        },
        "kubeletPlugin": {
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "containers": {"computeDomains": {"resources": {"limits": {"memory": "2Gi"}}}},
        },
    }
    objects = chart_with(helm, tmp_path, values)
    for kind, name in WORKLOADS:
        workload = find(objects, kind, name)
        assert container(workload)["image"] == "registry.example/cd:1.2.3"
        assert container(workload)["imagePullPolicy"] == "Always"
        assert pod_spec(workload)["imagePullSecrets"] == [{"name": "pull"}]
    controller = find(objects, "Deployment", "cd-controller")
    assert controller["spec"]["replicas"] == 3
    assert pod_spec(controller)["nodeSelector"] == {"role": "infra"}
    assert pod_spec(controller)["tolerations"] == [toleration]
    assert pod_spec(controller)["affinity"] == affinity
    agent = find(objects, "DaemonSet", "cd-node-agent")
    assert pod_spec(agent)["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    # Helm merges maps with the defaults: the requests stay, the limit changes.
    assert container(agent)["resources"] == {
        "requests": {"cpu": "50m", "memory": "128Mi"},
        "limits": {"memory": "2Gi"},
    }


def test_an_etcd_of_your_own_gives_the_production_overlays_flags_and_mounts(
    production: list[Obj], helm: Path, tmp_path: Path
) -> None:
    values = {
        "nvidiaDriverRoot": "/run/nvidia/driver",
        "etcd": {"enabled": False, "endpoints": HA_ETCD_MEMBERS.split(","), "tls": {"enabled": True}},
    }
    objects = chart_with(helm, tmp_path, values)
    # No etcd, certificates or roles Job of the chart's.
    assert {object_id(o) for o in objects if o["kind"] != "Namespace"} == {
        object_id(o) for o in production if o["kind"] != "Namespace" and "etcd" not in o["metadata"]["name"]
    }
    for kind, name in WORKLOADS:
        ours, theirs = find(objects, kind, name), find(production, kind, name)
        ours_flags = {k: v for k, v in flags(container(ours)).items() if k not in CHART_ONLY_FLAGS}
        theirs_flags = {k: v for k, v in flags(container(theirs)).items() if k not in ADVISOR_TLS_FLAGS}
        assert ours_flags == theirs_flags, name
        tls = {v["name"]: v for v in pod_spec(ours)["volumes"]}["etcd-tls"]
        assert tls == {v["name"]: v for v in pod_spec(theirs)["volumes"]}["etcd-tls"], name
        assert CERTS_ANNOTATION not in ours["spec"]["template"]["metadata"]["annotations"]


def test_an_etcd_of_your_own_without_tls(helm: Path, tmp_path: Path) -> None:
    objects = chart_with(helm, tmp_path, {"etcd": {"enabled": False, "endpoints": ["etcd.example:2379"]}})
    for kind, name in WORKLOADS:
        given = flags(container(find(objects, kind, name)))
        assert given["--etcd-endpoint"] == "etcd.example:2379"
        assert not {"--etcd-ca-file", "--etcd-cert-file", "--etcd-key-file"} & set(given)


def test_switches_drop_what_they_switch_off(helm: Path, tmp_path: Path) -> None:
    objects = chart_with(
        helm,
        tmp_path,
        {
            "serviceAccount": {"create": False},
            "placementAdvisor": {"networkPolicy": {"enabled": False}},
            "controller": {"metrics": {"enabled": False}},
        },
    )
    assert of_kind(objects, "ServiceAccount") == []
    assert of_kind(objects, "NetworkPolicy") == []
    controller_annotations = find(objects, "Deployment", "cd-controller")["spec"]["template"]["metadata"]
    assert not [key for key in controller_annotations["annotations"] if key.startswith("prometheus.io/")]
    advisor = find(objects, "Deployment", "cd-placement-advisor")
    assert advisor["spec"]["template"]["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_the_advisor_is_on_by_value(helm: Path, tmp_path: Path) -> None:
    objects = chart_with(helm, tmp_path, {"placementAdvisor": {"enabled": False}})
    assert [o for o in objects if "placement-advisor" in o["metadata"]["name"]] == []
    assert find(objects, "Deployment", "cd-controller")


def test_etcd_certificates_chain_to_one_ca_and_name_each_components_etcd_user(chart: list[Obj]) -> None:
    secrets = {s["metadata"]["name"]: s["data"] for s in of_kind(chart, "Secret")}

    def cert(name: str, key: str = "tls.crt") -> x509.Certificate:
        return x509.load_pem_x509_certificate(base64.b64decode(secrets[name][key]))

    ca = cert("cd-etcd-ca", "ca.crt")
    users = {
        "cd-etcd-client-root": "root",
        "cd-etcd-client-controller": roles.CONTROLLER,
        "cd-etcd-client-node-agent": roles.NODE_AGENT,
        "cd-etcd-client-imex-agent": roles.IMEX_AGENT,
        "cd-etcd-client-placement-advisor": roles.ADVISOR,
    }
    for name in [*users, "cd-etcd-server-tls", "cd-etcd-peer-tls"]:
        leaf = cert(name)
        leaf.verify_directly_issued_by(ca)
        assert base64.b64decode(secrets[name]["ca.crt"]) == base64.b64decode(secrets["cd-etcd-ca"]["ca.crt"])
        assert (leaf.not_valid_after_utc - leaf.not_valid_before_utc).days in (365, 366), name
    for name, user in users.items():
        [cn] = cert(name).subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        assert cn.value == user  # etcd takes the user from the CN
    # The names the services and the members dial (etcd/etcd.yaml's URLs).
    for name in ("cd-etcd-server-tls", "cd-etcd-peer-tls"):
        names = cert(name).extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert {f"*.cd-etcd.{NAMESPACE}.svc", "localhost"} <= set(names.get_values_for_type(x509.DNSName))
