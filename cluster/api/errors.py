"""The OpenAI error object (``{"error": {message, type, param, code}}``) and its status.

``OpenAIError`` is what every layer raises for a refusal a client caused (a 4xx) or an
unavailable engine (503); ``http_api`` renders it. ``from_validation_error`` turns a
pydantic failure into the 400 naming the first invalid field.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError


class OpenAIError(Exception):
    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# pydantic names the member of a union in ``loc`` (``("stop", "list[constrained-str]")``)
_UNION_TAG = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[|^[a-z]+-[a-z-]+$|^[A-Z]\w*$")


def from_validation_error(exc: ValidationError) -> OpenAIError:
    """The first invalid field as a 400; ``param`` is its dotted path.

    A union field fails once per member: a constraint a member of the right type broke
    says more than "should be a valid string" from the others, so it wins; when every
    member refused the type, the message lists what would have been accepted.
    """
    errors = exc.errors()
    field = errors[0]["loc"][:1]
    same = [e for e in errors if e["loc"][:1] == field]
    broken = [e for e in same if not e["type"].endswith(("_type", "_parsing"))]
    err = broken[0] if broken else same[0]
    param = ".".join(str(p) for p in err["loc"] if not _UNION_TAG.search(str(p))) or None
    msg = err["msg"].removeprefix("Value error, ")
    if not broken and len(same) > 1:
        msg = " or ".join(dict.fromkeys(e["msg"] for e in same))
    return OpenAIError(f"{param}: {msg}" if param else msg, param=param)
