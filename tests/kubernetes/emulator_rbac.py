"""Rule 8 of the emulated Kubernetes API server (tests/kubernetes/emulator.py) — a test double,
never part of the product: service account tokens and RBAC.

``POST .../serviceaccounts/NAME/token`` (the TokenRequest API) gives a token of an existing
ServiceAccount; a request bearing one is that account's, allowed only if a RoleBinding of its
namespace binds the account to a Role with a rule for the request's verb, API group and
resource, and recorded either way (``calls``).
"""

from __future__ import annotations

import uuid
from typing import Any

import kmock
from kmock._internal.rendering import Request


def _error(status: int, reason: str, message: str) -> kmock.KubernetesError:
    return kmock.KubernetesError(status=status, reason=reason, message=message, details={})


class Authorizing:
    """The emulator's tokens and authorization (mixed into ``FencedEmulator``)."""

    objects: Any  # KMock's store of every object
    tokens: dict[str, tuple[str, str]]  # token → (namespace, service account)
    calls: list[dict[str, Any]]  # each request of an account

    def _current(self, key: Any) -> dict[str, Any]:
        raise NotImplementedError

    def _token(self, request: Request) -> dict[str, Any]:
        account = (request.namespace or "", request.name or "")
        self._current((request.resource, *account))  # 404 for no such ServiceAccount
        token = uuid.uuid4().hex
        self.tokens[token] = account
        return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                "status": {"token": token}}  # fmt: skip

    def _account(self, request: Request) -> tuple[str, str] | None:
        header = next((v for k, v in request.headers.items() if k.lower() == "authorization"), "")
        if not header:
            return None
        account = self.tokens.get(header.removeprefix("Bearer ").strip())
        if account is None:
            raise _error(401, "Unauthorized", "Unauthorized")
        return account

    def _authorize(self, request: Request, method: str, account: tuple[str, str]) -> None:
        assert request.resource is not None
        if request.name is None:
            watching = request.params.get("watch") in ("true", "1")
            verb = {"GET": "watch" if watching else "list", "POST": "create",
                    "DELETE": "deletecollection"}.get(method, method.lower())  # fmt: skip
        else:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete",
                    "POST": "create"}.get(method, method.lower())  # fmt: skip
        group = request.resource.group or ""
        resource = request.resource.plural
        if request.subresource:
            resource += f"/{request.subresource}"
        namespace = request.namespace or ""
        allowed = any(
            (group in rule.get("apiGroups", ()) or "*" in rule.get("apiGroups", ()))
            and (resource in rule.get("resources", ()) or "*" in rule.get("resources", ()))
            and (verb in rule.get("verbs", ()) or "*" in rule.get("verbs", ()))
            for rule in self._rules(namespace, account)
        )
        user = f"system:serviceaccount:{account[0]}:{account[1]}"
        self.calls.append({"user": user, "verb": verb, "group": group, "resource": resource,
                           "namespace": namespace, "allowed": allowed})  # fmt: skip
        if not allowed:
            raise _error(403, "Forbidden", f'{user} cannot {verb} resource "{resource}" in API '
                         f'group "{group}" in the namespace "{namespace}"')  # fmt: skip

    def _rules(self, namespace: str, account: tuple[str, str]) -> list[dict[str, Any]]:
        """The rules of every Role a RoleBinding of `namespace` binds `account` to."""
        live = {
            (resource.plural, ns, name): obj.raw
            for (resource, ns, name), obj in self.objects.items()
            if not obj.deleted and resource.plural in ("roles", "rolebindings")
        }
        rules = []
        for (plural, ns, _), binding in live.items():
            if plural != "rolebindings" or ns != namespace:
                continue
            bound = any(
                subject.get("kind") == "ServiceAccount" and subject.get("name") == account[1]
                and subject.get("namespace", ns) == account[0]
                for subject in binding.get("subjects") or ()
            )  # fmt: skip
            role = live.get(("roles", ns, binding["roleRef"]["name"]))
            if bound and role is not None and binding["roleRef"].get("kind") == "Role":
                rules += role.get("rules") or []
        return rules
