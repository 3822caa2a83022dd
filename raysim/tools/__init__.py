"""The tools on top of the engine: run, sweep, compare, audit, privacy CLI, pretraining."""
