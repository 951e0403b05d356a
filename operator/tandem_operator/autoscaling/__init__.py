"""The P/D autoscaler (docs/architecture.md, "P/D autoscaling"), one module per step of a tick.

`spec` parses `spec.autoscaling`; `signals` turns the pods' `/metrics` into `Signals`; `planner` turns
those into replicas per role; `loop` is the kopf daemon that scrapes, plans and acts every interval.
"""
