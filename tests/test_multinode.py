"""Beyond one machine: two torchrun launchers ("nodes") meeting at a c10d rendezvous on loopback train the
same losses as one launcher with the same four ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import AVG_LOSS, ONE_ROW, TRAIN_PY, free_port, read_metrics, start_python, stop, train_py

# HSDP over 4 ranks: 2 replicas x 2 shards. Tiny so 2 x 4 processes fit on a shared 2-core machine.
TRAIN_ARGS = (*ONE_ROW, "--training.steps", "3", "--parallelism.data_parallel_replicate_degree", "2",
              "--parallelism.data_parallel_shard_degree", "2")
TIMEOUT_S = 300


def read_losses(dump: Path) -> list[float]:
    records = read_metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3]
    return [r[AVG_LOSS] for r in records]


@pytest.mark.slow
def test_two_launchers_with_c10d_rendezvous_match_one_launcher(tmp_path):
    # Two "nodes": the same command on both, as scripts/multinode.slurm runs it; the rendezvous assigns
    # the node ranks (whichever launcher binds the endpoint's port hosts the store, the other joins).
    port = free_port()
    nodes_dump = tmp_path / "two_nodes"  # shared by both "nodes", as on a cluster's shared file system
    multi_node = ("-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2", "--rdzv_backend", "c10d",
                  "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "titan_simple_test", TRAIN_PY, *TRAIN_ARGS,
                  "--job.dump_folder", nodes_dump)
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    launchers = [start_python(*multi_node, log=log) for log in logs]
    try:
        codes = [launcher.wait(timeout=TIMEOUT_S) for launcher in launchers]
    finally:
        for launcher in launchers:
            stop(launcher)
    texts = [log.read_text() for log in logs]
    output = "\n".join(f"--- {log.name}\n{text[-3000:]}" for log, text in zip(logs, texts, strict=True))
    assert codes == [0, 0], output
    # With --nnodes 2 neither launcher starts its ranks before the other has joined: one world of 4. The plan
    # line is at the top of a log whose tail may hold a launcher's rendezvous-shutdown trace (the other launcher
    # closed the store first; seen once, after every step had run): search the whole log.
    assert any("world 4 on " in text for text in texts), output

    single_dump = tmp_path / "one_node"
    train_py(*TRAIN_ARGS, "--job.dump_folder", single_dump, nproc=4, timeout=TIMEOUT_S)

    two_nodes, one_node = read_losses(nodes_dump), read_losses(single_dump)
    # The same 4 ranks, mesh and collectives in the same order: bitwise equal, not merely close.
    assert two_nodes == one_node
    # It trained: every step saw new data and changed the weights (shuffled plays: the loss need not fall yet).
    assert 7.0 < one_node[0] < 9.0 and len(set(one_node)) == len(one_node)
