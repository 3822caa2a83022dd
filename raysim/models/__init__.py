"""Models: CLIP via open_clip (with a CoOp prompt learner), PLMs, the heterogeneous client zoo."""
