"""What every Python worker of a GRPO node's Ray imports before it is given work, where RAY_WARM_WORKERS is on:
`ray start` gets RAY_preload_python_modules=app.rayworker, and Ray starts a worker per core when the first driver joins.

verl 0.9.1 starts its actors one after another (docs/gpu-runs.md run 45): TaskRunner, then TransferQueue's
controller and storage units, then the trainer, then vLLM, then the agent-loop workers, and each new process
spends 13-22 s importing verl before it does anything. The actors Ray places in its shared pool then find a worker
that has imported already. Those are verl's CPU actors, which Ray gives no GPU (CUDA_VISIBLE_DEVICES=""): the
imports see none either, as before. Workers started for one actor with an environment of their own import only
what that actor imports, as before: verl's trainer (WG_PREFIX, single_controller/ray/base.py), its vLLM server
(RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES, vllm_async_server.py), the launch's check of the nodes
(STACK_NODE_CHECK, app/launch.py).
"""

import importlib
import os

# TaskRunnerV1 (its run() imports the rest), TransferQueue, the v1 trainer with its agent loop, the reward loop
MODULES = ("verl.trainer.main_ppo", "transfer_queue", "verl.trainer.ppo.v1", "verl.experimental.reward_loop")
OWN_ENVIRONMENT = ("WG_PREFIX", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "STACK_NODE_CHECK")

env = os.environ  # set by Ray for this worker: an environment of its own (OWN_ENVIRONMENT), or the pool's
if not any(name in env for name in OWN_ENVIRONMENT):
    env["CUDA_VISIBLE_DEVICES"] = ""  # verl probes the GPU as it is imported (trainer/constants_ppo.py)
    for module in MODULES:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - the actor meets it again and reports it where it matters
            print(f"app.rayworker: {module} not preloaded ({type(exc).__name__}: {exc})", flush=True)
