"""Our CRD on the real API server: NVIDIA's ComputeDomain examples are accepted unchanged (and
defaulted as NVIDIA's CRD defaults them); malformed ComputeDomains are refused with the CRD's
messages."""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest
from kubernetes_asyncio.client import ApiClient

from tests.e2e import kube
from tests.e2e.harness import E2EEnvironment, example_objects

pytestmark = pytest.mark.e2e

EXAMPLES = ("imex-channel-injection.yaml", "imex-compute-domain.yaml", "nvbandwidth-test-compute-domain.yaml")


def _apply(env: E2EEnvironment, obj: dict[str, Any], *flags: str) -> subprocess.CompletedProcess[str]:
    return env.cp.kubectl("create", *flags, "-o", "json", "-f", "-", input=json.dumps(obj), check=False)


@pytest.mark.parametrize("example", EXAMPLES)
async def test_nvidia_example_is_accepted_unchanged_and_defaulted(
    e2e_env: E2EEnvironment, namespace: str, example: str
) -> None:
    docs = [d for d in example_objects(example) if d["kind"] == "ComputeDomain"]
    assert len(docs) == 1
    proc = _apply(e2e_env, docs[0], "-n", namespace, "--dry-run=server")
    assert proc.returncode == 0, proc.stderr
    created = json.loads(proc.stdout)
    assert created["spec"]["numNodes"] == docs[0]["spec"]["numNodes"]
    assert (
        created["spec"]["channel"]["resourceClaimTemplate"]
        == docs[0]["spec"]["channel"]["resourceClaimTemplate"]
    )
    assert created["spec"]["channel"]["allocationMode"] == "Single"  # the CRD's default


def _cd(namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "ComputeDomain",
        "metadata": {"name": "malformed", "namespace": namespace},
        "spec": spec,
    }


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"numNodes": -1, "channel": {"resourceClaimTemplate": {"name": "c"}}},
            "spec.numNodes: Invalid value: -1: spec.numNodes in body should be greater than or equal to 0",
        ),
        ({"numNodes": 2}, "spec.channel: Required value"),
        ({"channel": {}}, "spec.channel.resourceClaimTemplate: Required value"),
        (
            {"channel": {"resourceClaimTemplate": {"name": "c"}, "allocationMode": "Some"}},
            'spec.channel.allocationMode: Unsupported value: "Some": supported values: "Single", "All"',
        ),
    ],
)
async def test_malformed_computedomain_is_refused_with_the_crd_message(
    e2e_env: E2EEnvironment, namespace: str, spec: dict[str, Any], message: str
) -> None:
    proc = _apply(e2e_env, _cd(namespace, spec), "--dry-run=server")
    assert proc.returncode != 0, proc.stdout
    assert message in proc.stderr, proc.stderr


async def test_spec_change_after_create_is_refused(
    e2e_env: E2EEnvironment, api: ApiClient, namespace: str
) -> None:
    docs = [
        d for d in example_objects("nvbandwidth-test-compute-domain.yaml") if d["kind"] == "ComputeDomain"
    ]
    cd = {**docs[0], "metadata": {**docs[0]["metadata"], "namespace": namespace}}
    name = cd["metadata"]["name"]
    proc = _apply(e2e_env, cd)
    assert proc.returncode == 0, proc.stderr
    try:
        for patch in ({"spec": {"numNodes": 3}}, {"spec": {"channel": {"allocationMode": "All"}}}):
            proc = e2e_env.cp.kubectl(
                "patch",
                "computedomain",
                name,
                "-n",
                namespace,
                "--type=merge",
                "-p",
                json.dumps(patch),
                check=False,
            )
            assert proc.returncode != 0, proc.stdout
            assert "A computeDomain.spec is immutable" in proc.stderr, proc.stderr
        current = await kube.get_cd(api, namespace, name)
        assert current is not None and current["spec"]["numNodes"] == 2
        # Only the spec is frozen: metadata stays editable.
        proc = e2e_env.cp.kubectl(
            "patch", "computedomain", name, "-n", namespace, "--type=merge", "-p",
            json.dumps({"metadata": {"labels": {"team": "a"}}}),
            check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
    finally:
        await kube.delete_cd(api, namespace, name)

    async def gone() -> bool | None:
        return True if await kube.get_cd(api, namespace, name) is None else None

    await kube.eventually(gone, f"ComputeDomain {namespace}/{name} deleted", explain=e2e_env.explain)
