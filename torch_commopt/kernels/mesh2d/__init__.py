"""2D tensor parallelism (MeshSlice): sliced 2D GEMMs on an R x C mesh and their baselines."""
