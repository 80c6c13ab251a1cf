"""The benchmark library shared by ``grpo-mem bench`` and the scripts in ``benchmarks/``.

- ``grpo_mem.bench.measure``: wall/CPU time, peak RSS and live-tensor memory of an op in this process;
  ``grpo_mem.bench.isolate``: the same in a fresh process per run (``run_isolated``); ``grpo_mem.bench.results``: the
  long-format CSV, its plot and markdown tables; ``grpo_mem.bench.harness`` re-exports the three for the scripts;
  ``grpo_mem.bench.harness_cuda``: the measurement on a GPU.
- ``grpo_mem.bench.op_times``: each op on each backend at each shape, forward + backward: the table of measured
  per-op times that ``auto`` reads on CUDA (``grpo_mem/ops/op_times.csv``).
- ``grpo_mem.bench.sweep``: the one sweep runner: (configuration, provider) cells run one after the other, compared
  with stock TRL, turned into CSV rows.
- ``grpo_mem.bench.group``: the group-scoring op (models from a config, inputs, the stock TRL and grpo_mem
  providers); ``grpo_mem.bench.group_worker``: the worker measuring one provider; ``grpo_mem.bench.tokens``: the
  tokens through the backbone, grpo_mem against stock TRL (the benchmarks' ideal ratios).
- ``grpo_mem.bench.presets``: model shapes (published configurations, the benchmark scripts' models, a local
  ``config.json``); ``grpo_mem.bench.estimate``: a model's sizes and a GRPO step's peak memory per GPU on paper
  (stock TRL, grpo_mem, grpo_mem with sequence parallelism); ``grpo_mem.bench.fits``: the estimated peak of
  ``grpo-mem bench``'s scoring step, stock TRL's and grpo_mem's, against the memory available.

Nothing is imported here, so the child of every isolated run (``grpo_mem.bench.isolate``'s worker entry) starts clean.
"""
