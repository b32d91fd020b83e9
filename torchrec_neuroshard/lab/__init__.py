"""The lab: synthetic workloads, ground-truth measurement, data collection, pre-training.

Apart from the planner core: the core never imports the lab. The measuring and collecting
modules (``measure_compute``, ``measure_comm``, ``collect``, ``workloads``) need torch and
fbgemm only, so a machine without torchrec can collect pre-training data. The DMP
harness (``dmp_model``, ``dmp_measure``, ``dmp_report``) times real training steps of every
planner's plan; ``planners`` names the planners the benchmarks compare.
"""
