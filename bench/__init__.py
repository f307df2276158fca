"""lamina's benchmarks on one harness (ARCHITECTURE.md, docs/benchmarks.md).

`harness/` owns what every benchmark needs (commands and timing, the lamina
binary and its mounts, a registry, reference images, a fleet of nodes in
network namespaces, one results schema, tables and plots); each benchmark
is a module declaring `BENCHMARK` (its name, how it measures, how its
results render) and is run by `python3 -m bench NAME`.
"""
