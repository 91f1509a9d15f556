"""The driver's one-line view of lost workers (gspo_ascend/cluster.py), on Ray's own messages; the real thing
(a killed worker, a lost node) runs in tests/e2e/test_train_faults.py and tests/e2e/test_multinode.py."""

from __future__ import annotations

from gspo_ascend.cluster import _reason, placement_line

# str(ActorDiedError) of a training worker killed with SIGKILL (Ray 2.60), as the old driver printed it twice
ACTOR_DIED = (
    "The actor died unexpectedly before finishing this task.\n"
    "\tclass_name: PolicyWorker\n"
    "\tactor_id: 4f3655dc5e6ac4f07997400201000000\n"
    "\tpid: 931\n"
    "\tnamespace: de1c6077-7808-458a-a292-f67183cffec4\n"
    "\tip: 192.0.2.2\n"
    "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR Worker exit detail: "
    "Worker unexpectedly exits with a connection error code 2. End of file. Some common causes include: (1) the "
    "process was killed by the OOM killer due to high memory usage, (2) ray stop --force was called"
)
UNAVAILABLE = (
    "The actor 50c203b0600f71f569955c9903000000 is unavailable: The actor is temporarily unavailable: RpcError: "
    "RPC error: Socket closed rpc_code: 14. The task may or may not have been executed on the actor."
)


def test_the_reason_is_rays_first_sentence_after_the_ids():
    assert _reason(Exception(ACTOR_DIED)) == "The actor is dead because its worker process has died"
    assert _reason(Exception(UNAVAILABLE)) == (
        "The actor 50c203b0600f71f569955c9903000000 is unavailable: The actor is temporarily unavailable: "
        "RpcError: RPC error: Socket closed rpc_code: 14"
    )
    assert _reason(Exception("")) == "Exception"


def test_placement_line_names_each_rank_and_counts_nodes():
    nodes = [
        ("1a2b3c4d" + "0" * 48, "10.0.0.1"),
        ("5e6f7a8b" + "0" * 48, "10.0.0.2"),
        ("5e6f7a8b" + "0" * 48, "10.0.0.2"),
    ]
    assert placement_line(nodes) == (
        "workers: 3 rank(s) on 2 node(s): rank 0 on node 1a2b3c4d (10.0.0.1), rank 1 on node 5e6f7a8b (10.0.0.2), "
        "rank 2 on node 5e6f7a8b (10.0.0.2)"
    )
