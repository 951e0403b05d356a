"""What the planner's loop writes: the replicas patch, status.autoscaling and its lastScale history
(operator/tandem_operator/autoscaling/loop.py). The loop itself runs against a real control plane in
tests/operator/test_cluster_e2e.py."""

from __future__ import annotations

from planner_utils import Offered, System, config

from tandem_operator.autoscaling.loop import autoscaling_status, deletion_costs, replicas_patch
from tandem_operator.autoscaling.planner import Planner, Replicas
from tandem_operator.autoscaling.signals import EngineSample, Scrape, parse_engine


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


def engine(running: float, waiting: float = 0.0, held_blocks: float = 0.0) -> EngineSample:
    return EngineSample(running=running, waiting=waiting, kv_usage=0.1, max_num_seqs=64.0, prompt_tokens=0.0,
                        ttft=(), itl=(), held_blocks=held_blocks)


def test_a_scale_down_first_marks_each_pod_with_its_open_work_so_kubernetes_removes_the_idlest() -> None:
    planner = Planner(config(decode=(1, 4), prefill=(1, 4), down=0))
    system = System()
    current = Replicas(decode=3, prefill=2)
    plan = planner.plan(system.signals(0.0, Offered(streams=0.5), current), current)
    assert plan.decode.desired < 3 and plan.decode.scaling
    decode = {"d-busy": engine(5, 1), "d-idle": engine(0), "d-some": engine(2), "d-unread": None}
    prefill = {"p-holding": engine(0, held_blocks=40), "p-idle": engine(0)}
    costs = deletion_costs(plan, Scrape(time=0.0, router={}, decode=decode, prefill=prefill))
    # Only the roles that shrink, only the pods that answered (the ReplicaSet removes unready ones first
    # anyway); the cost is the work a pod would have to finish before it could leave.
    assert costs["decode"] == {"d-busy": 6, "d-idle": 0, "d-some": 2}
    assert ("prefill" in costs) == plan.prefill.scaling
    if plan.prefill.scaling:
        assert costs["prefill"] == {"p-holding": 40, "p-idle": 0}
    grow = Replicas(decode=1, prefill=1)
    up = Planner(config(decode=(1, 4), prefill=(1, 4), up=0))
    assert deletion_costs(up.plan(system.signals(0.0, Offered(streams=40.0), grow), grow),
                          Scrape(time=0.0, router={}, decode=decode, prefill=prefill)) == {}
    assert parse_engine("vllm:num_requests_running 2\ntandem:kv_blocks_held_for_transfer 7\n").held_blocks == 7
