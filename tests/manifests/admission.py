"""Offline evaluation of a ValidatingAdmissionPolicy's CEL with cel-python.

`PolicyEvaluator(policy).evaluate(request)` follows the API server's order: the request must match
`matchConstraints` (resource rules) and every `matchConditions` expression, then the `variables`
are computed and every validation is checked. It returns None when the policy does not apply and
otherwise the denial messages ([] = allowed). `params` is the object a binding's paramRef selects
(for our policies, their Namespace).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import celpy


@dataclass
class AdmissionRequest:
    operation: str  # CREATE, UPDATE, DELETE
    group: str
    version: str
    resource: str
    username: str
    extra: dict[str, list[str]] = field(default_factory=dict)
    object: dict[str, Any] | None = None
    old_object: dict[str, Any] | None = None


def _matches_rule(rule: dict[str, Any], req: AdmissionRequest) -> bool:
    def has(values: list[str], value: str) -> bool:
        return "*" in values or value in values

    return (
        has(rule.get("apiGroups", []), req.group)
        and has(rule.get("apiVersions", []), req.version)
        and has(rule.get("operations", []), req.operation)
        and has(rule.get("resources", []), req.resource)
    )


class PolicyEvaluator:
    def __init__(self, policy: dict[str, Any], params: dict[str, Any] | None = None) -> None:
        self.spec = policy["spec"]
        self.params = params
        self.env = celpy.Environment()
        self._programs: dict[str, Any] = {}

    def _eval(self, expression: str, activation: dict[str, Any]) -> Any:
        program = self._programs.get(expression)
        if program is None:
            program = self._programs[expression] = self.env.program(self.env.compile(expression))
        return program.evaluate(activation)

    def evaluate(self, req: AdmissionRequest) -> list[str] | None:
        rules = self.spec["matchConstraints"]["resourceRules"]
        if not any(_matches_rule(rule, req) for rule in rules):
            return None
        activation: dict[str, Any] = {
            "request": celpy.json_to_cel(
                {
                    "operation": req.operation,
                    "userInfo": {"username": req.username, "extra": req.extra},
                }
            ),
            "object": celpy.json_to_cel(req.object),
            "oldObject": celpy.json_to_cel(req.old_object),
            "params": celpy.json_to_cel(self.params),
        }
        for condition in self.spec.get("matchConditions") or []:
            if self._eval(condition["expression"], activation) != celpy.celtypes.BoolType(True):
                return None
        variables: dict[str, Any] = {}
        for variable in self.spec.get("variables") or []:
            activation["variables"] = celpy.celtypes.MapType(
                {celpy.celtypes.StringType(k): v for k, v in variables.items()}
            )
            variables[variable["name"]] = self._eval(variable["expression"], activation)
        activation["variables"] = celpy.celtypes.MapType(
            {celpy.celtypes.StringType(k): v for k, v in variables.items()}
        )
        denials = []
        for validation in self.spec["validations"]:
            result = self._eval(validation["expression"], activation)
            if result == celpy.celtypes.BoolType(True):
                continue
            if "messageExpression" in validation:
                denials.append(str(self._eval(validation["messageExpression"], activation)))
            else:
                denials.append(validation.get("message") or f"failed expression: {validation['expression']}")
        return denials
