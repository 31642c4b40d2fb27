"""A values file written for NVIDIA's chart (dra-driver-nvidia-gpu) renders here to what it means,
and a value that means nothing here fails the render naming itself (values.schema.json, and
templates/validation.yaml for what a schema cannot say). Rendered by the real helm."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.manifests.helm import CHART, HelmError, render
from tests.manifests.objects import NAMESPACE, Obj, container, env_values, find, flags, pod_spec
from tests.manifests.test_workloads import WORKLOADS

NODE_DAEMONSETS = ("cd-node-agent", "cd-imex-agent")
# The node labels NVIDIA's kubelet plugin is placed by (its chart's kubeletPlugin.affinity): node
# feature discovery's NVIDIA PCI device / CPU vendor labels, or the GPU operator's.
GPU_NODE_LABELS = [
    ("feature.node.kubernetes.io/pci-10de.present", "true"),
    ("feature.node.kubernetes.io/pci-0302_10de.present", "true"),
    ("feature.node.kubernetes.io/pci-0300_10de.present", "true"),
    ("feature.node.kubernetes.io/cpu-model.vendor_id", "NVIDIA"),
    ("nvidia.com/gpu.present", "true"),
]
# NVIDIA's chart's default values (v0.5.0-dev), but for the two that select its GPU plugin, which
# a user of ComputeDomains alone turns off: `helm show values` of their chart, as a user copies it.
NVIDIA_DEFAULTS: dict[str, Any] = {
    "nvidiaDriverRoot": "/",
    "nvidiaCDIHookPath": "",
    "altProcDevices": "",
    "nameOverride": "",
    "fullnameOverride": "",
    "namespaceOverride": "",
    "selectorLabelsOverride": {},
    "gpuResourcesEnabledOverride": False,
    "allowDefaultNamespace": False,
    "resourceApiVersion": "",
    "imagePullSecrets": [],
    "image": {"repository": "registry.example/dra", "pullPolicy": "IfNotPresent", "tag": ""},
    "serviceAccount": {"create": True, "annotations": {}, "name": ""},
    "resources": {"gpus": {"enabled": False}, "computeDomains": {"enabled": True}},
    "featureGates": {},
    "logVerbosity": "4",
    "webhook": {
        "enabled": False,
        "replicas": 1,
        "servicePort": 443,
        "priorityClassName": "system-cluster-critical",
        "tls": {"mode": "cert-manager", "certManager": {"issuerType": "selfsigned"}},
    },
    "controller": {
        "replicas": 1,
        "leaderElection": {
            "enabled": False,
            "leaseDuration": "15s",
            "renewDeadline": "10s",
            "retryPeriod": "2s",
        },
        "metrics": {"enabled": True, "httpEndpoint": ":8080", "metricsPath": "/metrics", "profilePath": ""},
        "priorityClassName": "system-node-critical",
        "podAnnotations": {},
        "podSecurityContext": {},
        "nodeSelector": {},
        "tolerations": [
            {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists", "effect": "NoSchedule"}
        ],
        "containers": {"computeDomain": {"securityContext": {}, "env": [], "resources": {}}},
        "affinity": {
            "nodeAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "preference": {
                            "matchExpressions": [
                                {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
                            ]
                        },
                    }
                ]
            }
        },
        "networkPolicy": {"enabled": False},
    },
    "kubeletPlugin": {
        "metrics": {
            "enabled": True,
            "gpuHttpEndpoint": ":8080",
            "computeDomainHttpEndpoint": ":8081",
            "metricsPath": "/metrics",
        },
        "priorityClassName": "system-node-critical",
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "100%"}},
        "podAnnotations": {},
        "podSecurityContext": {},
        "nodeSelector": {},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "kubeletRegistrarDirectoryPath": "/var/lib/kubelet/plugins_registry",
        "kubeletPluginsDirectoryPath": "/var/lib/kubelet/plugins",
        "containers": {
            "init": {"securityContext": {}, "resources": {}},
            "computeDomains": {
                "env": [],
                "securityContext": {"privileged": True},
                "resources": {},
                "healthcheckPort": 51515,
            },
            "gpus": {
                "env": [],
                "securityContext": {"privileged": True},
                "resources": {},
                "healthcheckPort": 51516,
            },
        },
        "networkPolicy": {"enabled": False},
    },
}


def node_affinity_labels(workload: Obj) -> list[tuple[str, str]]:
    terms = pod_spec(workload)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    labels = []
    for term in terms["nodeSelectorTerms"]:
        [expression] = term["matchExpressions"]
        assert expression["operator"] == "In"
        labels += [(expression["key"], value) for value in expression["values"]]
    return labels


def test_nvidias_default_values_render(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, NAMESPACE, NVIDIA_DEFAULTS, tmp_path)
    node_agent = find(objects, "DaemonSet", "cd-node-agent")
    volumes = {v["name"]: v for v in pod_spec(node_agent)["volumes"]}
    assert volumes["driver-root"]["hostPath"]["path"] == "/"
    assert flags(container(node_agent))["--log-level"] == "info"
    controller = find(objects, "Deployment", "cd-controller")
    assert controller["spec"]["replicas"] == 1
    assert pod_spec(controller)["priorityClassName"] == "system-node-critical"
    assert pod_spec(controller)["tolerations"] == NVIDIA_DEFAULTS["controller"]["tolerations"]
    assert node_agent["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == "100%"


def test_a_values_file_with_nvidias_names_renders_to_what_it_means(helm: Path, tmp_path: Path) -> None:
    resources = {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "3Gi"}}
    toleration = {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}
    affinity = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["gb200"]}]}
                ]
            }
        }
    }
    values = copy.deepcopy(NVIDIA_DEFAULTS)
    values.update(
        nvidiaDriverRoot="/run/nvidia/driver",
        resourceApiVersion="resource.k8s.io/v1beta1",
        image={"repository": "registry.example/cd", "tag": "v9.9.9", "pullPolicy": "Always"},
        imagePullSecrets=[{"name": "pull"}],
        logVerbosity="6",
        featureGates={"IMEXDaemonsWithDNSNames": True, "MPSSupport": False},
    )
    values["controller"].update(
        priorityClassName="high", nodeSelector={"role": "infra"}, tolerations=[toleration], affinity=affinity
    )
    values["controller"]["containers"]["computeDomain"].update(
        resources=resources, env=[{"name": "EXTRA", "value": "1"}]
    )
    values["kubeletPlugin"].update(
        priorityClassName="node-high", nodeSelector={"pool": "gb200"}, tolerations=[toleration]
    )
    values["kubeletPlugin"]["affinity"] = affinity
    values["kubeletPlugin"]["containers"]["computeDomains"]["resources"] = resources
    objects = render(helm, NAMESPACE, values, tmp_path)

    [device_class] = [o for o in objects if o["kind"] == "DeviceClass"]
    assert device_class["apiVersion"] == "resource.k8s.io/v1beta1"
    for kind, name in WORKLOADS:
        workload = find(objects, kind, name)
        assert container(workload)["image"] == "registry.example/cd:v9.9.9"
        assert container(workload)["imagePullPolicy"] == "Always"
        assert pod_spec(workload)["imagePullSecrets"] == [{"name": "pull"}]
        assert flags(container(workload))["--log-level"] == "debug"
    for name in NODE_DAEMONSETS:
        volumes = {v["name"]: v for v in pod_spec(find(objects, "DaemonSet", name))["volumes"]}
        assert volumes["driver-root"]["hostPath"]["path"] == "/run/nvidia/driver"
    controller = find(objects, "Deployment", "cd-controller")
    assert pod_spec(controller)["priorityClassName"] == "high"
    assert pod_spec(controller)["nodeSelector"] == {"role": "infra"}
    assert pod_spec(controller)["tolerations"] == [toleration]
    # Helm merges a map value into the default: NVIDIA's preferred control-plane term stays.
    assert pod_spec(controller)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert container(controller)["resources"] == resources
    assert env_values(container(controller))["EXTRA"] == "1"
    agent = find(objects, "DaemonSet", "cd-node-agent")
    assert pod_spec(agent)["priorityClassName"] == "node-high"
    assert pod_spec(agent)["nodeSelector"] == {"pool": "gb200"}
    assert pod_spec(agent)["tolerations"] == [toleration]
    assert container(agent)["resources"] == resources
    # A required node affinity given replaces the GPU-node terms (lists are replaced, not merged).
    assert node_affinity_labels(agent) == [("pool", "gb200")]


def test_both_node_daemonsets_run_on_gpu_nodes_only(helm: Path, tmp_path: Path) -> None:
    objects = render(helm, NAMESPACE)
    for name in NODE_DAEMONSETS:
        assert node_affinity_labels(find(objects, "DaemonSet", name)) == GPU_NODE_LABELS, name
    # null drops the default (Helm's way to delete a default map).
    objects = render(
        helm, NAMESPACE, {"kubeletPlugin": {"affinity": None}, "imexAgent": {"affinity": None}}, tmp_path
    )
    for name in NODE_DAEMONSETS:
        assert "affinity" not in pod_spec(find(objects, "DaemonSet", name)), name


# Values with no meaning here, each with the path the schema's message names.
REFUSED: list[tuple[str, dict[str, Any]]] = [
    ("/resources/gpus/enabled", {"resources": {"gpus": {"enabled": True}}}),
    ("/resources/computeDomains/enabled", {"resources": {"computeDomains": {"enabled": False}}}),
    ("/featureGates': additional properties 'NoSuchGate'", {"featureGates": {"NoSuchGate": True}}),
    ("/featureGates/MPSSupport", {"featureGates": {"MPSSupport": True}}),
    ("/featureGates/ComputeDomainCliques", {"featureGates": {"ComputeDomainCliques": True}}),
    ("/featureGates/IMEXDaemonsWithDNSNames", {"featureGates": {"IMEXDaemonsWithDNSNames": False}}),
    ("/kubeletPlugin': additional properties 'nodeSelectr'", {"kubeletPlugin": {"nodeSelectr": {"a": "b"}}}),
    ("/controller/containers/computeDomain': additional properties 'resource'", {"controller": {"containers": {"computeDomain": {"resource": {}}}}}),
    ("/kubeletPlugin/containers/gpus/resources", {"kubeletPlugin": {"containers": {"gpus": {"resources": {"limits": {"cpu": "1"}}}}}}),
    ("/kubeletPlugin/containers/computeDomains/healthcheckPort", {"kubeletPlugin": {"containers": {"computeDomains": {"healthcheckPort": 9000}}}}),
    ("/nvidiaCDIHookPath", {"nvidiaCDIHookPath": "/usr/bin/nvidia-cdi-hook"}),
    ("/serviceAccount/name", {"serviceAccount": {"name": "mine"}}),
    ("/webhook/enabled", {"webhook": {"enabled": True}}),
    ("/controller/leaderElection/leaseDuration", {"controller": {"leaderElection": {"leaseDuration": "30s"}}}),
    ("/resourceApiVersion", {"resourceApiVersion": "resource.k8s.io/v1alpha3"}),
    ("/logVerbosity", {"logVerbosity": "verbose"}),
    ("'': additional properties 'namespace'", {"namespace": "gpu-system"}),
]  # fmt: skip


def test_each_value_with_no_meaning_here_fails_naming_itself(helm: Path, tmp_path: Path) -> None:
    # One render: the schema reports every violation, each by its path.
    values: dict[str, Any] = {}
    for _, value in REFUSED:
        merge_into(values, value)
    with pytest.raises(HelmError) as refused:
        render(helm, NAMESPACE, values, tmp_path)
    message = str(refused.value)
    missing = [path for path, _ in REFUSED if f"at '{path}" not in message and path not in message]
    assert missing == [], message


@pytest.mark.parametrize(
    ("values", "namespace", "message"),
    [
        ({}, "default", 'installing into the namespace "default" is refused'),
        ({"etcd": {"enabled": False}}, NAMESPACE, "etcd.enabled=false needs etcd.endpoints"),
        ({"etcd": {"endpoints": ["a:2379"]}}, NAMESPACE, "etcd.endpoints names an etcd of your own"),
    ],
)
def test_combinations_the_schema_cannot_refuse_fail_naming_the_values(
    helm: Path, tmp_path: Path, values: dict[str, Any], namespace: str, message: str
) -> None:
    with pytest.raises(HelmError, match=message):
        render(helm, namespace, values, tmp_path)
    if namespace == "default":  # NVIDIA's way out
        render(helm, namespace, {"allowDefaultNamespace": True}, tmp_path)


@pytest.mark.parametrize(("version", "accepted"), [("1.31.9", False), ("1.32.13", True), ("1.37.2", True)])
def test_kube_version_admits_1_32_to_1_37(helm: Path, version: str, accepted: bool) -> None:
    proc = subprocess.run(
        [str(helm), "template", "cd", str(CHART), "-n", NAMESPACE, "--kube-version", version],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (proc.returncode == 0) == accepted, proc.stderr
    if not accepted:
        assert "kubeVersion" in proc.stderr or "incompatible" in proc.stderr, proc.stderr


def merge_into(target: dict[str, Any], source: dict[str, Any]) -> None:
    for key, value in source.items():
        if isinstance(value, dict) and isinstance(target.get(key), dict):
            merge_into(target[key], value)
        else:
            target[key] = copy.deepcopy(value)
