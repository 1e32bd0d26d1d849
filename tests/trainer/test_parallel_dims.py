"""`tandem.trainer.parallel.dims`: closing the ranks ends what the process group started."""

import gc
import os

import torch
from torch.distributed.fsdp import fully_shard

from tandem.trainer.parallel.dims import close_parallel, init_parallel


def native_threads() -> set[tuple[int, str]]:
    """This process's threads (id and name), C++ threads included."""
    return {(int(t), open(f"/proc/self/task/{t}/comm").read().strip()) for t in os.listdir("/proc/self/task")}


def test_closing_the_ranks_joins_the_groups_threads_though_dtensor_caches_keep_the_mesh():
    """An FSDP step leaves the world mesh in DTensor's caches, and the mesh kept its groups: gloo's worker and socket
    threads outlived `destroy_process_group` into interpreter teardown (a rank's abort after its last step)."""
    before = native_threads()
    dims = init_parallel("cpu")
    model = torch.nn.Linear(8, 4)
    fully_shard(model, mesh=dims.mesh)
    model(torch.randn(3, 8)).sum().backward()
    started = {name for _, name in native_threads() - before}
    assert any("gloo" in name for name in started), started  # the check below watches the threads it means to
    del model, dims
    close_parallel()
    gc.collect()  # as `tandem.cli` does once its command returns: the FSDP state held the groups in cycles
    assert native_threads() - before == set()
