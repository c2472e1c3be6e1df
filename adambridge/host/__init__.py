"""The host machine: the OS calls it has, its CPUs and NUMA nodes, host memory."""
