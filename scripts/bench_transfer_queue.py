"""Time TransferQueue (verl 0.9.1's v1 data plane: SimpleStorage over ZMQ, 8 storage units, a real local Ray)
moving GRPO-sized batches in and out, as verl's trainer_base does with kv_batch_put / kv_batch_get: is the data
plane where a v1 GRPO step spends its time (docs/benchmarks.md, GRPO round 1)?

    pip install --target <dir> transferqueue==0.1.11 pyzmq msgspec     # not in the CPU suite's lock
    PYTHONPATH=<dir> python scripts/bench_transfer_queue.py

Batches: 1,024 samples of ~55 tokens (the demo's GRPO step) and 320 of ~900 (bench_grpo.sh's), 8 jagged fields.
"""
import os
import time

import ray, torch
from omegaconf import OmegaConf
from tensordict import TensorDict
import transfer_queue as tq
import verl

# 16 logical CPUs: the controller and the 8 storage units are actors that each take one
ray.init(num_cpus=16, include_dashboard=False, _node_ip_address="127.0.0.1")
conf = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer/config/transfer_queue/transfer_queue.yaml"))
conf.enable = True
tq.init(OmegaConf.create({"transfer_queue": conf}).transfer_queue)

def batch(n, plen, rlen, fields=8):
    lens = torch.randint(rlen // 2, rlen + 1, (n,))
    def nt(dtype, extra):
        return torch.nested.as_nested_tensor([torch.zeros(int(extra + l), dtype=dtype) for l in lens], layout=torch.jagged)
    d = {f"f{i}": nt(torch.long if i % 2 else torch.float32, plen if i < 4 else 0) for i in range(fields)}
    return TensorDict(d, batch_size=[n]), int(lens.sum()) + n * plen

for step, (n, plen, rlen) in enumerate([(1024, 50, 6), (1024, 50, 6), (320, 150, 1000), (320, 150, 1000)]):
    td, tokens = batch(n, plen, rlen)
    keys = [f"s{step}_{i}" for i in range(n)]
    t = time.perf_counter(); tq.kv_batch_put(keys=keys, partition_id="train", fields=td); put = time.perf_counter() - t
    t = time.perf_counter(); out = tq.kv_batch_get(keys=keys, partition_id="train"); get = time.perf_counter() - t
    t = time.perf_counter(); out = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["f0", "f5"]); get2 = time.perf_counter() - t
    print(f"{n} samples, {tokens} tokens: put {put:.2f}s, get all {get:.2f}s, get 2 fields {get2:.2f}s", flush=True)
tq.close(); ray.shutdown()
