"""One generation request's path through the gateway, as named stages, each a module:

parse (who asks, what) → resolve (base model and adapter, live workers) → tokenize (prompt, completion
budget, sampling) → job (request id, queued message, record) → admit (fair share, overload) → route
(a worker, and the reservation it holds there) → enqueue (on the worker's queue, or attach to a copy
already there) → respond (relay the output as SSE or one JSON body) → finish (metrics, the decision's
outcome, the tenant's charge). `gateway.openai_api` runs them in order; a new request feature (n,
logprobs, tools, structured output) changes the stage it belongs to.
"""
