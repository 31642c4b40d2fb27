"""Kubernetes' name rules (libs/kube/names.py) on the API server's own examples and edge cases."""

from __future__ import annotations

import pytest

from libs.kube.names import label_problem, subdomain_problem


@pytest.mark.parametrize("name", ["a", "0", "team-a", "a" * 63, "1-2-3"])
def test_valid_labels(name: str) -> None:
    assert label_problem(name) is None


@pytest.mark.parametrize("name", ["", "A", "a.b", "-a", "a-", "a_b", "é", "a" * 64, "Bad/NS"])
def test_invalid_labels_say_why(name: str) -> None:
    problem = label_problem(name)
    assert problem is not None and "DNS-1123 label" in problem


@pytest.mark.parametrize("name", ["a", "my-job", "a.b", "example.com", "a" * 253, "0.1"])
def test_valid_subdomains(name: str) -> None:
    assert subdomain_problem(name) is None


@pytest.mark.parametrize("name", ["", "UPPER", "a/b", "a..b", ".a", "a.", "a-.b", "a" * 254, "a b"])
def test_invalid_subdomains_say_why(name: str) -> None:
    problem = subdomain_problem(name)
    assert problem is not None and "DNS-1123 subdomain" in problem
    assert len(problem) < 300
