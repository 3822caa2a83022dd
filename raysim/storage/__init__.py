"""Run folders on disk: the state store, the run lock and the run-folder reader."""
