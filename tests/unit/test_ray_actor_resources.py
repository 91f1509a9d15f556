"""Ray actor options for a placement bundle (gspo_ascend.workers.actor_resources): the first GPU run of this build
(docs/results/gpu/) found `gspo-ascend train` unable to start a single worker on CUDA, because the GPU unit of a
bundle went into ``resources``, which Ray refuses for its own CPU / GPU resources. The real Ray is the judge here:
a local Ray that declares one GPU (Ray schedules GPUs it is told of on a CPU host too) places a worker asking for
one, and hands it GPU id 0."""

from __future__ import annotations

import pytest

from gspo_ascend.workers import actor_resources


def test_cpu_and_gpu_are_rays_keywords_and_npu_a_custom_resource():
    assert actor_resources({"CPU": 2}) == {"num_cpus": 2, "num_gpus": 0, "resources": {}}
    assert actor_resources({"CPU": 1, "GPU": 1}) == {"num_cpus": 1, "num_gpus": 1, "resources": {}}
    assert actor_resources({"CPU": 1, "NPU": 1}) == {"num_cpus": 1, "num_gpus": 0, "resources": {"NPU": 1}}


@pytest.mark.slow
def test_a_real_ray_places_a_gpu_worker_with_these_options():
    ray = pytest.importorskip("ray")
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    class Probe:
        def gpu_ids(self):
            return ray.get_gpu_ids()

    bundle = {"CPU": 1, "GPU": 1}
    ray.init(num_cpus=2, num_gpus=1, include_dashboard=False, log_to_driver=False)
    try:
        with pytest.raises(ValueError, match="num_gpus"):  # what the worker group passed before
            ray.remote(Probe).options(num_cpus=1, resources={"GPU": 1})
        pg = placement_group([bundle], strategy="PACK")
        ray.get(pg.ready(), timeout=60)
        strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
        actor = ray.remote(Probe).options(**actor_resources(bundle), scheduling_strategy=strategy).remote()
        assert ray.get(actor.gpu_ids.remote(), timeout=120) in ([0], ["0"])
    finally:
        ray.shutdown()
