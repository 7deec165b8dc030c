"""Tensor parallelism on torch.distributed: how a model is cut across ranks (partition), this
process's place in the group and its collectives (parallel_state), where the ranks run and meet
(layout), and which CPU cores each rank gets (cpu_binding)."""
