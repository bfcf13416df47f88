"""The xPyD planner behind ``pdserve plan``: a product feature, not a benchmark.

Profile the engine on this machine (profile.py), fit a step cost model
(costmodel.py), simulate colocated and xPyD layouts on a workload (simulate.py,
sim_instances.py), search the highest rate that meets the SLO (sweep.py) and
recommend a layout (plan.py). Builds on bench.load's workloads and metrics only.
"""
