"""Code generation: per-stage schedules, stitching into one function, target backends."""
