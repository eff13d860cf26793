"""OpenAI's file expiration policy: `expires_after` on an upload (multipart fields
`expires_after[anchor]`, `expires_after[seconds]`) and `output_expires_after` on a batch (its
output and error files). The anchor is the file's `created_at`; the seconds are OpenAI's range,
one hour to 30 days. A file past its `expires_at` is gone, as if deleted (files.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvserve.batch.errors import BatchAPIError

MIN_SECONDS, MAX_SECONDS = 3600, 30 * 24 * 3600
FORM_FIELDS = ("expires_after[anchor]", "expires_after[seconds]")


class ExpiresAfter(BaseModel):
    """A batch's `output_expires_after` (JSON), validated as OpenAI's."""

    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: StrictInt = Field(ge=MIN_SECONDS, le=MAX_SECONDS)


def form_expires_after(form) -> int | None:
    """The seconds an upload's form asks it to live, None when it sets no policy; a policy OpenAI
    would refuse is a 400 naming the form field."""
    if "expires_after" in form:
        raise BatchAPIError(
            400, "expires_after: send it as the form fields expires_after[anchor] and expires_after[seconds]",
            "expires_after",
        )  # fmt: skip
    anchor, seconds = (form.get(k) for k in FORM_FIELDS)
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        field = "expires_after[anchor]"
        raise BatchAPIError(400, f"{field}: {anchor!r} is not supported (only 'created_at')", field)
    if not isinstance(seconds, str) or not seconds.isascii() or not seconds.isdigit():
        raise BatchAPIError(400, "expires_after[seconds]: required, an integer", "expires_after[seconds]")
    if len(seconds) > 9 or not MIN_SECONDS <= int(seconds) <= MAX_SECONDS:  # (a 5,000-digit int raises)
        field = "expires_after[seconds]"
        message = f"{field}: must be from {MIN_SECONDS} (1 hour) to {MAX_SECONDS} (30 days), not {seconds}"
        raise BatchAPIError(400, message, field)
    return int(seconds)
