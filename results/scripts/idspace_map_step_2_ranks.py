"""The managed map's time a step at 2 gloo ranks, in the checkout given (argv[1]): the sharded map's
IdSpace.map_step, or the replicated map's gather and update (main at 1dac7b8); argv[2] profiles rank 0."""

import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import numpy as np


def rank_main(rank, world, port, tree, steps, prof):
    sys.path.insert(0, tree)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    import yaml

    from streamtrain.config import FeaturesConfig

    raw = yaml.safe_load(Path(tree, "deploy/worker.yaml").read_text())["features"]
    for t in raw["tables"]:
        if t["name"] in ("user_id", "adgroup_id"):
            t.pop("num_embeddings")
            t.update(id_mapping="managed", rows=1501, **({"buckets": 16} if "h40" in tree else {}))
    features = FeaturesConfig.model_validate(raw)
    from streamtrain.idspace import IdSpace

    dist.init_process_group("gloo", rank=rank, world_size=world)
    ids = IdSpace(features, world, None)
    rng = np.random.default_rng(rank)
    names = [t.name for t in ids.tables]
    times = []
    pr = cProfile.Profile() if (prof and rank == 0) else None
    for s in range(steps):
        own = {n: torch.from_numpy(rng.integers(0, 2400, 1024) + s * 3) for n in names}
        dist.barrier()
        if pr and s == 50:
            pr.enable()
        t0 = time.perf_counter()
        if hasattr(ids, "map_step"):
            ids.map_step(own, 1000 + s)
        else:
            from streamtrain.idspace import _Mapped

            everyone, now, mine = ids._gather(own, 1000 + s)
            st = ids.mapping.update(everyone, now)
            m = _Mapped(st, ids.mapping.step)
            ids.in_flight.append(m)
            ids.to_reset.append(m)
            {n: x.rows[mine[n]] for n, x in st.items()}
        times.append(time.perf_counter() - t0)
        ids.before_forward()
        if len(ids.in_flight) > 2:
            ids.trained()
    if pr:
        pr.disable()
        pstats.Stats(pr).sort_stats("cumtime").print_stats(25)
    if rank == 0:
        print(tree, "ms/step median", round(float(np.median(times[50:])) * 1e3, 3), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    sys.path.insert(0, "/work/main")
    from streamtrain.dev.kafka import free_port

    tree = sys.argv[1]
    prof = len(sys.argv) > 2
    mp.spawn(rank_main, args=(2, free_port(), tree, 400, prof), nprocs=2)
