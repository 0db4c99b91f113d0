"""A CPU engine keeps freed host memory for reuse (``workers/host_memory.py``): a forward off
the main thread does not page its activations in again at every step."""

from __future__ import annotations

import gc
import random
import resource

import torch

from cluster.bench.inproc import make_bench_model
from workers.host_memory import retained
from workers.llm import LLM
from workers.sampling.params import SamplingParams


def test_overlap_prefills_do_not_fault_their_memory_in_again(tmp_path):
    """16 x 64-token prompts, overlap on (the prefill runs on the forward thread): with glibc
    trimming the thread's arena after each step every run faults its activations in again;
    with the thresholds the engine sets it does not."""
    torch.set_num_threads(1)
    llm = LLM(
        model=str(make_bench_model(tmp_path / "m")),
        device="cpu",
        dtype="float32",
        scheduler={"overlap": True},
        cache={"max_kv_tokens": 16384},
    )
    assert retained()
    rng = random.Random(0)
    prompts = [[rng.randrange(16, 200) for _ in range(64)] for _ in range(16)]
    params = [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)] * len(prompts)
    faults = []  # the whole process's: anything else alive in it adds, so best of 4
    for _ in range(5):
        llm.flush_cache()
        gc.collect()
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        llm.generate_ids(prompts, params)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults[1:]) < 3000, faults
