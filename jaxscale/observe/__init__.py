"""What a run reports: the metrics file, loggers, throughput and MFU, profiling, plots and the sharding report.

Import the submodules directly."""
