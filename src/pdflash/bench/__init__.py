"""Benchmarks of the engine in the regimes it serves: `pdflash bench` (measured, time-scaled link)
and `pdflash simulate` (the real scheduler and eviction policies on a virtual clock at real shapes).

Modules: profiles (deployments, time scaling), configs (B0-B3), workload, runner, calibrate,
metrics, report, routing (traces, Zipf model), costs, sim_cache, simulator, commands and the
two command bodies (bench_main, simulate_main). See docs/benchmarks.md.
"""
