"""Routing policies: which worker (and, for `model: "auto"`, which base model) serves a request.

Pure code, no I/O and no torch: the gateway and the simulator feed it snapshots and act on its answers.

* `types` — RouteRequest, Candidate, RouteDecision; `framework` — Filter, Scorer, Picker, Profile.
* `filters/`, `scorers/`, `pickers/` — the built-in plugins, one per module; `plugin_types` maps their types.
* `document` — the policy document (YAML/JSON) → `Policy`; `default_policy` — the built-in document.
* `prefix_index` — which KV blocks each worker holds, from its KV events or from routing.
* `difficulty`, `difficulty_learned`, `estimators` — difficulty scores; `alias_ladder` — an alias's ladder of
  models, one rung per difficulty band.
* `fairness` — per-tenant fair queueing by tokens served (VTC) for the gateway's admission.
* `cli` — `loragate policy validate | train-difficulty | default`.
"""
