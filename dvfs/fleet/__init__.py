"""Campaigns across many GPUs: one module, one job.

`shard.py` deals a campaign's whole comparison groups to job arrays (`dvfs sweep --shard i/n`);
`shard_journal.py` reads a shard's journal and cube; `devices.py` turns `--gpus` or the
campaign's `gpu.devices` groups into workers' GPU groups; `queue.py` hands whole comparison
groups to workers, each run drafter-major; `worker.py` runs cells on one GPU group and ships
their records; `driver.py` journals what the workers ship; `local.py` runs the workers as
threads of this process and `ray_executor.py` as Ray actors.
"""
