"""Stage admit: the overload check and the tenant's fair turn (`gateway.admission`), and the charge it
makes, settled exactly once: with the tokens served when the request finishes, or refunded when it never
reached a worker (its client left while it waited, routing refused it, a copy was queued first, Redis
failed). A request that fails after it was queued keeps its admission-time estimate."""

from __future__ import annotations

from starlette.requests import Request

from gateway.admission import FairAdmission
from gateway.context import GatewayContext
from gateway.errors import APIError
from gateway.pipeline.prompt import Prompt


class Charge:
    def __init__(self, admission: FairAdmission, tenant: str, base: str, amount: float):
        self.admission, self.tenant, self.base, self.amount = admission, tenant, base, amount
        self.settled = False

    def settle(self, prompt_tokens: int, completion_tokens: int) -> None:
        """Correct the charge to the tokens served (the first call only)."""
        if not self.settled:
            self.settled = True
            self.admission.settle(self.tenant, self.base, self.amount, prompt_tokens, completion_tokens)

    def refund(self) -> None:
        """Nothing was served."""
        self.settle(0, 0)


async def admit(ctx: GatewayContext, request: Request, tenant: str, base: str, prompt: Prompt) -> Charge:
    admission, waits = ctx.admission, ctx.admission.waited
    amount = await admission.admit(tenant, base, len(prompt.token_ids), prompt.max_tokens)
    charge = Charge(admission, tenant, base, amount)
    # A request that waited for its fair turn may have lost its client meanwhile: drop it here, before
    # a worker reads (and prefills) it. Skipped on the fast path (no wait, no check).
    if admission.waited != waits and await request.is_disconnected():
        charge.refund()
        raise client_closed()
    return charge


def client_closed() -> APIError:
    return APIError(499, "The client closed the request.", code="client_closed_request")
