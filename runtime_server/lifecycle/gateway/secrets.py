"""The gateway's handlers of named secrets (docs/protocol.md, "Secrets"): ``PUT
/v1/secrets/NAME`` sets one, ``GET /v1/secrets`` lists their names, keys and versions — never a
value — and ``DELETE /v1/secrets/NAME`` removes one. A value never reaches a log line, an error
message or an answer.
"""

from __future__ import annotations

from fnkernel.runtime_server.errors import InvalidField
from fnkernel.runtime_server.lifecycle.gateway.handlers import BaseHandler, BodyHandler
from fnkernel.runtime_server.lifecycle.secrets import MAX_SECRET_BYTES, check_secret


class SecretsHandler(BaseHandler):
    async def get(self) -> None:
        secrets = await self.blocking(self.gateway.secrets.list)
        self.send_json(200, {"secrets": [secret.shown() for secret in secrets]})


class SecretHandler(BodyHandler):
    # Its keys and values, which JSON escaping can make up to six times as long, and room.
    max_body = 6 * MAX_SECRET_BYTES + 4096

    async def put(self, name: str) -> None:
        body = self.json_body()
        if unknown := sorted(set(body) - {"data"}):  # refused, as a Run's unknown field is
            raise InvalidField(unknown[0], "is not a field of a secret; its field: data")
        name, data = check_secret(name, body.get("data"))
        secret = await self.blocking(self.gateway.secrets.set, name, data)
        self.send_json(200, secret.shown())

    async def delete(self, name: str) -> None:
        await self.blocking(self.gateway.secrets.delete, name)
        self.set_status(204)
        self.finish()
