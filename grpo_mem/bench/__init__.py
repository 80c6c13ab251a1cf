"""The benchmark library shared by ``grpo-mem bench`` and the scripts in ``benchmarks/``.

- ``grpo_mem.bench.harness``: fresh-process runs, wall/CPU time, peak RSS and live-tensor memory, the long-format CSV,
  plot and markdown table; ``grpo_mem.bench.harness_cuda``: the same measurement on a GPU.
- ``grpo_mem.bench.sweep``: the one sweep runner: (configuration, provider) cells run one after the other, compared
  with stock TRL, turned into CSV rows.
- ``grpo_mem.bench.group``: the group-scoring op (models from a config, inputs, the stock TRL and grpo_mem providers,
  the worker measuring one provider).
- ``grpo_mem.bench.presets``: model shapes (published configurations, the benchmark scripts' models, a local
  ``config.json``); ``grpo_mem.bench.estimate``: stock TRL's estimated peak memory against what is available.

Nothing is imported here, so ``python -m grpo_mem.bench.harness`` (the child of every isolated run) starts clean.
"""
