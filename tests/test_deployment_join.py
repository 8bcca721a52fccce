"""A job's deployment is resolved once: in a parallel job (two processes over gloo) building its
LLM joins the process group exactly once, waiting the job's --parallel-timeout for its peers, and
the LLM it builds generates what one process does."""

import json
import socket

import torch.multiprocessing as mp

from flexoff.policy import Policy, TierFractions
from flexoff.runtime.sampling import SamplingParams
from tests import processes

TIMEOUT_S = 123.0
PROMPTS = [[5, 9, 11, 3], [7, 7, 21, 30]]
# Offloaded, so that each stage holds a share of its layers' weights on each tier.
POLICY = Policy(2, 1, weights=TierFractions(0.5, 0.5, 0), cache=TierFractions(1, 0, 0),
                activations=TierFractions(1, 0, 0))


def _params() -> SamplingParams:
    return SamplingParams(max_new_tokens=3, ignore_eos=True)


def _process(rank: int, model: str, tmp, port: int) -> None:
    import os
    from datetime import timedelta

    import torch.distributed as dist

    from flexoff.commands.llm import job_deployment, make_llm
    from flexoff.deploy.parallel import Ranks
    from flexoff.job import Job, PolicySource
    from flexoff.planner.cost_model import Workload

    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    joins, groups = [], []
    join, init = Ranks.join, dist.init_process_group

    def counted_join(self):
        joins.append(self.parallel.timeout_s)
        return join(self)

    def counted_init(*args, timeout=None, **kwargs):
        groups.append(timeout)
        return init(*args, timeout=timeout, **kwargs)

    Ranks.join, dist.init_process_group = counted_join, counted_init
    job = Job(model=model, dummy=False, device="cpu", policy=PolicySource(str(tmp / "policy.json")), ignore_eos=True,
              pipeline_parallel=2, parallel_timeout=TIMEOUT_S, offload_dir=str(tmp))
    llm = make_llm(job_deployment(job), job, lambda: Workload(4, 3, len(PROMPTS)))
    try:
        tokens = [out.token_ids for out in llm.generate(PROMPTS, _params())]
    finally:
        llm.close()
    (tmp / f"rank{rank}.json").write_text(json.dumps({
        "joins": joins, "groups": [t == timedelta(seconds=TIMEOUT_S) for t in groups], "tokens": tokens}))


def test_an_llm_of_a_two_process_job_joins_its_group_once_with_the_jobs_timeout(tiny_model_dir, tmp_path):
    from flexoff import LLM

    path, _ = tiny_model_dir("opt-pre")
    with LLM(str(path), device="cpu", policy=POLICY, offload_dir=str(tmp_path)) as llm:
        alone = [out.token_ids for out in llm.generate(PROMPTS, _params())]
    POLICY.save(tmp_path / "policy.json")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.start_processes(_process, args=(str(path), tmp_path, port), nprocs=2, join=False, start_method="spawn")
    processes.wait_until(lambda: context.join(timeout=1), "the two processes to end")
    for rank in range(2):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen["joins"] == [TIMEOUT_S]  # one join, the job's timeout on it
        assert seen["groups"] == [True]  # one process group, told that timeout
        assert seen["tokens"] == alone
