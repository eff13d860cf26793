"""A refused budget in LiteLLM's words: "Budget has been exceeded! Key=... Current cost: X, Max
budget: Y" (Team=... for a team's), type budget_exceeded. Its users' alerts and scripts grep
for that sentence; the gateway's own ("key: budget 5 limit reached; ...") matched none of them.
What follows the sentence says what LiteLLM's cannot: the gateway refuses a request whose
maximum cost does not fit (LiteLLM lets it run past the budget), and when a retry may pass."""

from __future__ import annotations

from kvserve.gateway.model_limits import owner_of
from kvserve.gateway.state import Admission
from kvserve.gateway.state.base import EPS


def exceeded(adm: Admission, key_name: str) -> str:
    """LiteLLM's sentence for the budget that refused `adm`: Key=<alias>, Team=<id> or User=<id>."""
    c = adm.failed
    assert c is not None and c.kind == "budget"
    kind, _, name = owner_of(c).partition(":")
    who = {"team": "Team=" + name, "user": "User=" + name}.get(kind, "Key=" + key_name)
    spent = adm.spent if adm.spent is not None else c.limit  # (an earlier version's memo: none)
    # (rounded: a sum of prices printed as 4.0, not 4.000000000000001)
    cost = f"Current cost: {round(spent, 9)}, Max budget: {round(c.limit, 9)}"
    model = c.model
    if model is not None:  # (LiteLLM's model_max_budget refusal names the key or user, and the model)
        owners = {"user": "User: ", "team": "Team: "}
        owner = owners[kind] + name if kind in owners else f"Virtual Key: {key_name}"
        who = f"LiteLLM {owner}, exceeded budget for model={model}."
    return f"Budget has been exceeded! {who} {cost}"


def request_refused(adm: Admission, key_name: str, retry: int | None) -> str:
    """A request's refusal; retry: the Retry-After seconds, None where no retry admits it."""
    c = adm.failed
    assert c is not None
    ask = f"{exceeded(adm, key_name)}; this request may cost up to {c.amount:.6g}"
    if retry is None:
        return f"{ask}, and the budget does not reset (no budget_duration): no retry admits it"
    spent = adm.spent if adm.spent is not None else c.limit
    if spent + c.amount > c.limit * (1 + EPS):
        return f"{ask}; the budget resets in {retry} s (budget_duration)"
    return f"{ask}, and requests in flight hold the rest until they settle; retry after {retry} s"
