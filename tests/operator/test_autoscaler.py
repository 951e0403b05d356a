"""What the planner's loop writes: the replicas patch, status.autoscaling and its lastScale history
(operator/tandem_operator/autoscaler.py). The loop itself runs against a real control plane in
tests/operator/test_cluster_e2e.py."""

from __future__ import annotations

from planner_utils import Offered, System, config

from tandem_operator.autoscaler import autoscaling_status, replicas_patch
from tandem_operator.planner import Planner, Replicas


def test_a_step_patches_only_the_roles_that_move_and_records_why() -> None:
    planner = Planner(config(decode=(1, 4), prefill=(1, 4), up=0))
    system = System()
    sig = system.signals(0.0, Offered(streams=40.0), Replicas(decode=1, prefill=1))
    plan = planner.plan(sig, Replicas(decode=1, prefill=1))
    assert replicas_patch(plan) == {"decode": {"replicas": plan.decode.desired}} and plan.decode.desired > 1
    status = autoscaling_status(sig, plan, None)
    assert status["desiredReplicas"] == {"prefill": 1, "decode": plan.decode.desired}
    assert status["reasons"]["decode"].startswith(f"decode 1->{plan.decode.desired}: ")
    (step,) = status["lastScale"]["steps"]
    assert (step["role"], step["from"], step["to"]) == ("decode", 1, plan.decode.desired)
    assert status["signals"]["decode"]["pods"] == 1 and status["signals"]["router"]["readable"] is True

    # A tick that changes nothing (decode already at its maximum) writes no replicas and keeps the last
    # step on record.
    at_max = Replicas(decode=4, prefill=1)
    quiet = planner.plan(system.signals(15.0, Offered(streams=40.0), at_max), at_max)
    assert not quiet.decode.scaling and replicas_patch(quiet) == {}
    kept = autoscaling_status(sig, quiet, status)
    assert kept["lastScale"] == status["lastScale"] and kept["reasons"]["decode"].startswith("decode 4: ")
    assert "lastScale" not in autoscaling_status(sig, quiet, None)
