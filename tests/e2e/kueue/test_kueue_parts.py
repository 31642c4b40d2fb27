"""The Kueue harness's pure parts: the webhook configurations it registers (from the module's own
manifests) and the decoding of Kueue's compressed topology assignment."""

from __future__ import annotations

import base64

import pytest
import yaml

from tests.e2e.kueue.manager import WEBHOOK_GROUPS, kueue_build, loopback_webhooks
from tests.e2e.kueue.queued_job import assigned_pods


def test_the_registered_webhooks_are_the_jobs_and_kueues_own_each_by_url_with_the_ca() -> None:
    manifests = [
        d for d in yaml.safe_load_all((kueue_build() / "webhook" / "manifests.yaml").read_text()) if d
    ]
    configs = loopback_webhooks(manifests, "https://127.0.0.1:9443", b"CA PEM", "e2e-kueue")
    assert sorted(c["kind"] for c in configs) == [
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
    ]
    hooks = [h for c in configs for h in c["webhooks"]]
    names = {h["name"] for h in hooks}
    assert {"mjob.kb.io", "vjob.kb.io", "mworkload.kb.io", "vworkload.kb.io"} <= names, names
    assert "mpod.kb.io" not in names and "mdeployment.kb.io" not in names  # integrations left off
    for hook in hooks:
        groups = {g for rule in hook["rules"] for g in rule["apiGroups"]}
        assert groups <= WEBHOOK_GROUPS, hook
        assert set(hook["clientConfig"]) == {"url", "caBundle"}, hook
        assert hook["clientConfig"]["url"].startswith("https://127.0.0.1:9443/")
        assert base64.b64decode(hook["clientConfig"]["caBundle"]) == b"CA PEM"
    assert all(c["metadata"]["name"].startswith("e2e-kueue-") for c in configs)


def test_a_compressed_topology_assignment_decodes_to_pods_per_domain() -> None:
    assignment = {
        "levels": ["nvidia.com/gpu.clique", "kubernetes.io/hostname"],
        "slices": [
            {
                "domainCount": 3,
                "valuesPerLevel": [
                    {"universal": "c1"},
                    {"individual": {"prefix": "rack1-tray", "roots": ["0", "2", "3"]}},
                ],
                "podCounts": {"individual": [2, 1, 1]},
            },
            {
                "domainCount": 1,
                "valuesPerLevel": [
                    {"universal": "c0"},
                    {"individual": {"roots": ["rack0-tray1"], "suffix": ""}},
                ],
                "podCounts": {"universal": 1},
            },
        ],
    }
    assert assigned_pods(assignment) == {
        ("c1", "rack1-tray0"): 2,
        ("c1", "rack1-tray2"): 1,
        ("c1", "rack1-tray3"): 1,
        ("c0", "rack0-tray1"): 1,
    }


def test_a_slice_whose_values_do_not_match_its_domain_count_is_refused() -> None:
    bad = {
        "levels": ["kubernetes.io/hostname"],
        "slices": [
            {
                "domainCount": 2,
                "valuesPerLevel": [{"individual": {"roots": ["a"]}}],
                "podCounts": {"universal": 1},
            }
        ],
    }
    with pytest.raises(ValueError, match="malformed topology assignment"):
        assigned_pods(bad)
