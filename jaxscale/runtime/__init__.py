"""The process around a run: simulated devices and multi-host start-up, pre-emption, TPU pod commands.

Import the submodules directly."""
